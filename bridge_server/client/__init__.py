"""Clients of a running server: the Python client (`client.py`) and the `vllm-bridge` commands that
call a server (`commands.py`). They depend on the wire package alone.
"""
