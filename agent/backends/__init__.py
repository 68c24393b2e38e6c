"""The engines fleet serves with, one sub-package each (`llama_cpp`, `torch`, `pipeline`: a launch
spec and its worker), and what they share: the launch spec's types (`launch`), the OpenAI wire
format (`openai_wire`), the ASGI lifespan answer (`asgi`). The registry that picks one is
agent/serving/registry.py."""
