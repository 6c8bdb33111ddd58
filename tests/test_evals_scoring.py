"""Teacher-forced exact match equals real step-by-step greedy decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctx.data.tokenizers import ByteTokenizer
from lctx.evals import build_example, eval_seed, make_batch, make_haystack, score_answers
from lctx.evals.tasks import RetrievalExample

TOK = ByteTokenizer()
E, D, MAX_T = 259, 32, 512


def _toy_params(seed=0):
  """A 1-layer causal attention LM with learned positions, random weights."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  n = lambda k, shape, s: jax.random.normal(k, shape) * s
  return {
    "emb": n(ks[0], (E, D), 1.0),
    "pos": n(ks[1], (MAX_T, D), 0.5),
    "wq": n(ks[2], (D, D), D**-0.5),
    "wk": n(ks[3], (D, D), D**-0.5),
    "wv": n(ks[4], (D, D), D**-0.5),
    "out": n(ks[5], (D, E), 2.0),
  }


@jax.jit
def _toy_forward(params, inputs, positions, segment_ids):
  """inputs/positions/segment_ids int32 [B, T] -> logits float32 [B, T, E]."""
  x = params["emb"][inputs] + params["pos"][positions]  # [B, T, D]
  q, k, v = x @ params["wq"], x @ params["wk"], x @ params["wv"]
  s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
  t = inputs.shape[1]
  mask = (jnp.arange(t)[:, None] >= jnp.arange(t)[None, :])[None]
  mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
  s = jnp.where(mask, s, -1e9)
  h = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, axis=-1), v)
  return jnp.tanh(h) @ params["out"]


PARAMS = _toy_params()
CALLS = []


def logits_fn(batch):
  CALLS.append(batch["inputs"].shape)
  return np.asarray(_toy_forward(PARAMS, batch["inputs"], batch["positions"], batch["segment_ids"]))


_GREEDY = {}


def greedy_decode(prompt, n):
  """Real autoregressive greedy decoding, one unpadded forward per token
  (memoised: each new length compiles the toy model once more)."""
  key = (tuple(int(t) for t in prompt), n)
  if key not in _GREEDY:
    _GREEDY[key] = _greedy_decode(prompt, n)
  return list(_GREEDY[key])


def _greedy_decode(prompt, n):
  seq = list(prompt)
  for _ in range(n):
    x = np.asarray(seq, np.int32)[None]
    logits = logits_fn(
      {"inputs": x, "positions": np.arange(x.shape[1])[None], "segment_ids": np.ones_like(x)}
    )
    seq.append(int(np.argmax(logits[0, -1])))
  return seq[len(prompt) :]


def _with_answer(ex, answer_ids):
  tokens = np.concatenate([ex.tokens[: ex.answer_start], answer_ids]).astype(np.int32)
  return RetrievalExample(**{**ex.__dict__, "tokens": tokens, "answer": ""})


def test_teacher_forced_exact_match_equals_greedy_decoding():
  hs = make_haystack("noise", TOK)
  examples = []
  for i in range(4):
    ex = build_example("passkey", 150 + 7 * i, 0.5, eval_seed(9, i), TOK, hs)
    n = len(ex.tokens) - ex.answer_start
    greedy = np.asarray(greedy_decode(ex.tokens[: ex.answer_start], n), np.int32)
    wrong_last = greedy.copy()
    wrong_last[-1] = (wrong_last[-1] + 1) % E
    wrong_first = greedy.copy()
    wrong_first[0] = (wrong_first[0] + 5) % E
    # gold = the greedy output (must score 1), one token off at the end or the
    # start (must score 0), and the real passkey answer (whatever greedy says).
    examples += [
      _with_answer(ex, greedy),
      _with_answer(ex, wrong_last),
      _with_answer(ex, wrong_first),
      ex,
    ]
  CALLS.clear()
  scores = score_answers(logits_fn, examples, batch_size=3, length_multiple=16)
  assert all(shape[0] == 3 and shape[1] % 16 == 0 for shape in CALLS)
  for ex, sc in zip(examples, scores):
    n = len(ex.tokens) - ex.answer_start
    decoded = greedy_decode(ex.tokens[: ex.answer_start], n)
    assert sc["exact"] == float(decoded == ex.tokens[ex.answer_start :].tolist())
  exact = [s["exact"] for s in scores]
  assert exact[0::4] == [1.0] * 4 and exact[1::4] == [0.0] * 4
  assert exact[2::4] == [0.0] * 4
  # wrong_last keeps every other answer token right under teacher forcing.
  assert all(0.0 < s["token_acc"] < 1.0 for s in scores[1::4])


def test_loglik_matches_unpadded_per_token_forward():
  hs = make_haystack("noise", TOK)
  ex = build_example("niah_single", 240, 0.25, eval_seed(10), TOK, hs)
  [sc] = score_answers(logits_fn, [ex], batch_size=2, length_multiple=64)
  total = 0.0
  for t in range(ex.answer_start, len(ex.tokens)):
    x = ex.tokens[:t][None]
    logits = logits_fn(
      {"inputs": x, "positions": np.arange(t)[None], "segment_ids": np.ones_like(x)}
    )[0, -1].astype(np.float64)
    total += logits[ex.tokens[t]] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
  np.testing.assert_allclose(sc["loglik"], total, rtol=1e-5, atol=1e-4)


def test_make_batch_right_pads():
  b = make_batch([np.array([5, 6, 7]), np.array([8])], batch_size=3, length_multiple=4)
  np.testing.assert_array_equal(b["inputs"], [[5, 6, 7, 0], [8, 0, 0, 0], [0] * 4])
  np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 0], [0, 0, 0, 0], [0] * 4])
  np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 0], [1, 0, 0, 0], [0] * 4])
  assert all(v.dtype == np.int32 for v in b.values())
  with pytest.raises(ValueError, match="batch_size=1"):
    make_batch([np.array([1]), np.array([2])], batch_size=1)


@pytest.mark.slow  # ~10-40 s: five compiles of the flax model
def test_real_transformer_padding_invariant_and_greedy():
  """lctx.models.Transformer (tiny, reference attention): right padding to a
  length multiple leaves the scores unchanged, and exact match == greedy."""
  from lctx import configs
  from lctx.models import Transformer

  model = Transformer(configs.model_config("tiny", vocab_size=E))
  x0 = np.zeros((1, 8), np.int32)
  params = model.init(jax.random.PRNGKey(1), x0, x0, x0 + 1)["params"]
  apply = jax.jit(lambda x, p, s: model.apply({"params": params}, x, p, s))
  fn = lambda b: np.asarray(apply(b["inputs"], b["positions"], b["segment_ids"]))
  ex = build_example("passkey", 120, 0.0, eval_seed(11), TOK, make_haystack("noise", TOK))
  ex = _with_answer(ex, ex.tokens[ex.answer_start : ex.answer_start + 2])  # " d"
  n = len(ex.tokens) - ex.answer_start  # 2 steps: each new length compiles
  seq = list(ex.tokens[: ex.answer_start])
  for _ in range(n):  # real greedy decoding, unpadded
    x = np.asarray(seq, np.int32)[None]
    seq.append(
      int(
        fn({"inputs": x, "positions": np.arange(x.shape[1])[None], "segment_ids": np.ones_like(x)})[
          0, -1
        ].argmax()
      )
    )
  greedy = np.asarray(seq[ex.answer_start :], np.int32)
  examples = [ex, _with_answer(ex, greedy)]
  plain = score_answers(fn, examples, batch_size=2, length_multiple=1)
  padded = score_answers(fn, examples, batch_size=2, length_multiple=64)
  for a, b in zip(plain, padded):
    assert a["exact"] == b["exact"]
    np.testing.assert_allclose(a["loglik"], b["loglik"], rtol=1e-5, atol=1e-5)
  assert padded[1]["exact"] == 1.0
  assert padded[0]["exact"] == float(np.array_equal(greedy, ex.tokens[ex.answer_start :]))
