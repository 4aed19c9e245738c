"""Code that runs INSIDE the vLLM server process (its own environment, without our package's dependencies).

The server gets this directory on its PYTHONPATH (see `serving/vllm_server.py`), so its modules are imported by their
top-level names (e.g. `eagle3_hs_connector`); they import only vLLM, torch, safetensors and the standard library.
"""
