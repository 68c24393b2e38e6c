"""llama.cpp for GGUF: the launch spec (`spec`) and the worker (`worker`)."""
