"""Hugging Face checkpoints in and out (Llama 1/2/3.x and Mixtral), without torch.

One job per module:
  hfconfig  config.json <-> `model.*` (and the fields jaxpar cannot represent: HFError)
  layout    which HF tensor fills which jaxpar param, and the transposes/reshapes between them
  reading   safetensors (one file or sharded with an index) -> params placed on their shardings
  writing   params -> safetensors (+ index when sharded), config.json (+ generation_config.json)
  init      `train.init_from` (hf:DIR or a jaxpar checkpoint): the model config and the params
  convert   `jaxpar convert from-hf` / `to-hf`

Kept import-free so that importing one module (the trainer imports `init`) loads only it.
"""
