"""The target's CPU threads follow its load (serve/cpu_threads.py)."""

import torch

from dlite_ray.serve.cpu_threads import LoadFollowingThreads, target_thread_policy


def test_every_core_for_one_request_and_one_fewer_under_load():
    before = torch.get_num_threads()
    policy = LoadFollowingThreads(solo=3, busy=2)
    try:
        seen = []
        for running in (1, 0, 2, 5, 1):
            policy(running)
            seen.append(torch.get_num_threads())
        assert seen == [3, 3, 2, 2, 3]
    finally:
        torch.set_num_threads(before)


def test_a_fixed_count_an_accelerator_or_a_thread_variant_kernel_has_no_policy(tiny_serving_model, monkeypatch):
    from dlite_ray.runtime.loading import load_target

    target = load_target(tiny_serving_model[0])
    assert target_thread_policy("cpu", 2, target) is None
    assert target_thread_policy("cuda", None, target) is None
    monkeypatch.setattr("dlite_ray.serve.cpu_threads.decode_kernel_serves", lambda head_dim, dtype: False)
    assert target_thread_policy("cpu", None, target) is None
    monkeypatch.setattr("dlite_ray.serve.cpu_threads.decode_kernel_serves", lambda head_dim, dtype: True)
    policy = target_thread_policy("cpu", None, target)
    assert policy is not None and policy.busy == max(1, policy.solo - 1)
