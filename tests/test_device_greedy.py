"""Greedy tokens picked on the device (engine/stage.py `greedy_on_device`, the default on GPUs): the same ids as
numpy's argmax of the logits that the host path copies out, through prompts and decode steps, batched or not."""
import numpy as np
from tinygrad import Device

from engine.stage import Column, Sampling, Stage
from tests.tiny_gguf import write_tiny_gguf


def test_device_argmax_picks_what_the_host_picks(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=2, dim=64, ffn_dim=128, vocab_size=256, qtype="Q8_0")
    runs = {}
    for on_device in (False, True):
        s = Stage.load(p, 0, 2, n_slots=2, max_context=64)
        s.greedy_on_device = on_device
        got = [s.step([Column(i, 0, i == 4, t) for i, t in enumerate([3, 17, 42, 7, 99])]),
               s.step([Column(i, 1, i == 2, t) for i, t in enumerate([5, 6, 200])])]
        for i in range(3):  # two sequences decoding side by side, then one alone
            got.append(s.step([Column(5 + i, 0, True, int(got[-1][0]) if i else 11), Column(3 + i, 1, True, 1 + i)]))
        got.append(s.step([Column(8, 0, True, 9)]))
        got.append(s.step([Column(9, 0, False, 9)]))  # no logits wanted: no ids
        # a sampled column still goes through the logits (greedy_on_device applies to greedy steps only)
        got.append(s.step([Column(6, 1, True, 4)], sampling=Sampling(temperature=0.8, seed=3)))
        logits = s.step_logits([Column(7, 1, True, 4)])
        runs[on_device] = (got, logits)
        assert all(g.dtype == np.int32 for g in got) and got[-2].shape == (0,)
    host, dev = runs[False], runs[True]
    assert all(np.array_equal(a, b) for a, b in zip(host[0], dev[0]))
    assert np.array_equal(host[1], dev[1])
    # the default: on the device on GPUs; the CPU keeps the host pick (its logits are in host memory already)
    assert Stage.load(p, 0, 2, n_slots=1, max_context=64).greedy_on_device == (not Device.DEFAULT.startswith("CPU"))


def test_greedy_ids_on_a_gpu_layout_are_numpys_argmax():
    """The tree of reductions GPUs take (engine/stage.py `greedy_ids`: every device but the CPU), run on tinygrad's
    PYTHON device: ties go to the first index, a row of -inf gives 0, vocab sizes off the tree's fan-out."""
    from tinygrad import Tensor
    from engine.stage import greedy_ids
    rng = np.random.default_rng(5)
    for vocab, rows in ((1000, 3), (257, 2), (33, 1), (7, 2)):
        a = rng.standard_normal((rows, vocab)).astype(np.float32)
        a[0, vocab // 3] = a[0, vocab - 1] = 40.0
        if rows > 1:
            a[1] = -np.inf
        got = greedy_ids(Tensor(a, device="PYTHON")).numpy()
        assert got.dtype == np.int32 and np.array_equal(got, np.argmax(a, axis=1)), (vocab, got)
