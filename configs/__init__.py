"""Platform YAML files (efa, broadcom-thor2, ...), installed as package data of uccl_ep_plugin.configs."""
