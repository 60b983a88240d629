"""Engine plugins for uccl_ep_plugin (SGLang, vLLM), installed as the package uccl_ep_plugin.integrations."""
