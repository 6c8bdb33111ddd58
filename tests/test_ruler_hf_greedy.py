"""scripts/ruler_hf_greedy.py's check that transformers' greedy decoding equals
lctx's from one forward of prompt + lctx's tokens (a tiny random Llama)."""

import importlib.util
import os

import helpers
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Tok:
  eos_id = 7
  pad_id = 0

  def decode(self, ids):
    return " ".join(str(i) for i in ids)


def _script():
  spec = importlib.util.spec_from_file_location(
    "ruler_hf_greedy", os.path.join(ROOT, "scripts", "ruler_hf_greedy.py")
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_verify_agrees_with_generate_and_finds_the_first_difference(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  script = _script()
  path = helpers.save_tiny_llama(str(tmp_path / "llama"))
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  tok = _Tok()
  rng = np.random.default_rng(0)
  for _ in range(3):
    prompt = [int(x) for x in rng.integers(10, 280, 40)]
    ids = script._generate(model, tok, prompt, 6)
    assert 0 < len(ids) <= 6 and tok.eos_id not in ids
    assert script._verify(model, tok, prompt, ids, 6, ()) == (None, "budget")
    # stopped by the references: what follows does not matter
    assert script._verify(model, tok, prompt, ids[:2], 6, (tok.decode(ids[1:2]),)) == (
      None,
      "references",
    )
    # a differing token, and a stop that transformers would not make (no EOS next)
    wrong = ids[:2] + [(ids[2] + 1) % 288] + ids[3:]
    assert script._verify(model, tok, prompt, wrong, 6, ()) == (2, "argmax")
    assert script._verify(model, tok, prompt, ids[:3], 6, ()) == (3, "after the last token")
