"""One value vocabulary (common.values): the same Column and Sampling, with the same rules, on the wire, in the
coordinator and in the engine; per-column sampling on the wire."""
import subprocess
import sys

import pytest

from common.values import Column, Sampling, samplings_for
from mesh import proto


def roundtrip(ev):
    a, b = proto.Codec(), proto.Codec()
    b.receive_data(a.send(ev))
    return b.next_event()


def test_the_old_names_are_the_one_type():
    import engine.sampling
    import engine.stage
    import engine.worker_proto
    assert engine.stage.Column is proto.Column is engine.worker_proto.WireColumn is Column
    assert engine.stage.Sampling is engine.sampling.Sampling is proto.SamplingParams is proto.Sampling is Sampling


@pytest.mark.parametrize("kwargs, field", [
    ({"top_p": 1.5}, "top_p"), ({"top_p": -0.1}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_k": 2 ** 32}, "top_k"),
    ({"top_k": 1.5}, "top_k"), ({"seed": -1}, "seed"), ({"seed": 2 ** 64}, "seed"), ({"seed": True}, "seed"),
])
def test_one_rule_everywhere_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"Sampling.{field}"):
        Sampling(**kwargs)


def test_what_the_engine_accepts_the_wire_carries_and_back():
    # top_p=0 used to pass the wire and fail in the engine: now it is one value, "the most likely token only"
    s = Sampling(temperature=1, top_k=0, top_p=0, seed=2 ** 64 - 1)
    assert type(s.temperature) is float and type(s.top_p) is float and s.temperature == 1.0
    ev = proto.Step(1, 0, 5, (7,), None, s)
    assert roundtrip(ev).sampling == s
    import numpy as np
    from engine.sampling import pick_token
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    assert pick_token(logits, s, 17) == 1


def test_a_bad_sampling_on_the_wire_is_malformed_naming_the_field():
    import struct
    good = proto.Codec().send(proto.Step(1, 0, 5, (7,), None, Sampling()))
    bad = good[:-20] + struct.pack("<d", 1.5) + good[-12:]  # top_p, sent by a sender that skipped the rule
    c = proto.Codec()
    c.receive_data(bad)
    with pytest.raises(proto.ProtocolError, match="top_p"):
        c.next_event()


def test_batch_step_carries_one_sampling_per_column():
    cols = (Column(10, 0, True, 1), Column(3, 1, False, 2), Column(4, 1, True, 3))
    per = (Sampling(0.7, 40, 0.9, 1), Sampling(1.2, 0, 1.0, 2))
    ev = roundtrip(proto.BatchStep(4, False, cols, None, per))
    assert ev.sampling == per and ev.columns == cols
    assert type(ev.columns[0]) is Column and type(ev.sampling[0]) is Sampling
    # one for all: a single Sampling becomes a 1-tuple
    assert proto.BatchStep(4, False, cols, None, per[0]).sampling == (per[0],)
    with pytest.raises(ValueError, match="3 Sampling entries for 2 columns"):
        proto.BatchStep(4, False, cols, None, per + per[:1])


def test_samplings_for_counts_against_the_logits_columns():
    cols = [Column(0, 0, True), Column(0, 1, False), Column(0, 2, True)]
    assert samplings_for(Sampling(), cols) == (Sampling(),)
    assert samplings_for([Sampling(seed=1), Sampling(seed=2)], cols) == (Sampling(seed=1), Sampling(seed=2))
    with pytest.raises(ValueError, match="must be Sampling"):
        samplings_for([{"seed": 1}], cols)


def test_the_coordinator_and_the_wire_load_no_tinygrad():
    code = ("import sys, mesh.coordinator, mesh.pipeline, mesh.proto, common.values; "
            "bad = [m for m in sys.modules if m.startswith(('tinygrad', 'engine.stage'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
