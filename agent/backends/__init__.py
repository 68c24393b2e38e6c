"""Server backends: how each engine is launched (llama.cpp for GGUF, PyTorch for safetensors)."""
