"""The HF extraction backend across devices (issue 14): a target that one GPU cannot hold is
spread, whole layers at a time, over the devices the lease grants. On the CPU: the map itself for
the seed's 61 layers over 8 GPUs, and a load through that device map over two CPU "devices",
whose hidden states must equal the one-device forward's."""

import torch
from transformers import AutoConfig

from eyrie_extractor.capture import HFCapture, spread_devices, spread_map
from tests.support.harness import TINY


def test_61_layers_over_8_gpus_in_even_contiguous_blocks():
    config = AutoConfig.from_pretrained(TINY)
    config.num_hidden_layers = 61
    devices = [f"cuda:{i}" for i in range(8)]
    mapping = spread_map(config, devices)  # a weightless skeleton: no GPU, no memory
    layers = [mapping[f"model.layers.{i}"] for i in range(61)]
    assert layers == sorted(layers, key=devices.index)  # contiguous: one hop per device boundary
    assert [layers.count(d) for d in devices] == [8] * 7 + [5]
    assert mapping["model.embed_tokens"] == "cuda:0"
    assert mapping["model.norm"] == mapping["lm_head"] == "cuda:7"


def test_devices_named_are_used_and_one_device_stays_one():
    assert spread_devices(str(TINY), "cuda:0,cuda:1") == ["cuda:0", "cuda:1"]
    assert spread_devices(str(TINY), "cpu") == ["cpu"]
    assert spread_devices(str(TINY), "cuda") == ["cuda"]  # no GPU here: nothing to spread over


def test_a_spread_target_gives_the_same_hidden_states():
    ids = [[1, 5, 9, 20, 33, 7], [4, 8, 15, 16]]
    whole = HFCapture(str(TINY), [1, 2], "cpu", dtype=torch.float32)
    spread = HFCapture(str(TINY), [1, 2], "cpu,cpu", dtype=torch.float32)
    assert spread.device_map["model.layers.0"] == "cpu" and len(spread.device_map) > 3
    # (one CPU is one device: transformers places the modules without dispatch hooks; the hooks and
    # the hops between GPUs are what bench/gpu_checks.py leaves to a machine with several GPUs)
    a, b = whole.forward(ids), spread.forward(ids)
    assert a.shape == b.shape == (2, 6, 3, whole.hidden_size)
    assert torch.allclose(a[0], b[0], atol=1e-6) and torch.allclose(a[1, :4], b[1, :4], atol=1e-6)
