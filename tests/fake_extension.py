"""An extension that only reports build features, for the engine-choice tests that need no kernels."""


class FakeExtension:
    def __init__(self, features):
        self.features = features

    def build_info(self):
        return {"features": self.features}

    def use_torch_shim(self, libtorch_path, to_tensors, from_tensors, tensor_type, gpu_library_path, current_stream):
        """As the real one, where torch's C shim is there."""
