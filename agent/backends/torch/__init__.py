"""PyTorch/transformers for safetensors: the launch spec (`spec`), the HTTP worker (`worker`),
the batched scheduler (`engine`), layer ranges (`layers`), the prefix cache (`prefix`), text."""
