"""A placement policy added without editing pdserve (pdserve/router/placement_policies.py):
tests/plugins/toy_placement.py, named by ``--pd-policy toy_placement:LastWorker`` with its folder
on the router's Python path, runs in a real router in front of two real role-both workers: every
request decodes on the worker with the highest key, and its output equals the offline engine's."""
from __future__ import annotations

from pathlib import Path

from bench import deployment as services
from pdserve.common.engine import SamplingParams
from pdserve.v1 import common_pb2, router_pb2

PLUGINS = Path(__file__).parents[1] / "plugins"


def test_a_toy_policy_serves_every_request_on_its_worker(tmp_path, monkeypatch, offline):
    monkeypatch.setenv("PYTHONPATH", str(PLUGINS))
    prompts = [offline.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is a moraine?", "Name a glacier.", "Why is ice blue?")]
    expected = [o.token_ids for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=6),
                                                       use_tqdm=False)]
    dep = services.start(tmp_path, decode_role="both", num_decode=2, num_prefill=0,
                         router_args=["--pd-policy", "toy_placement:LastWorker"])
    try:
        got = []
        for tokens in prompts:
            req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=tokens),
                                             params=common_pb2.SamplingParams(temperature=0, max_tokens=6))
            got.append([t for msg in dep.router_stub().Generate(req, timeout=120) for t in msg.token_ids])
        assert got == expected
        # prompt tokens looked up in each worker's prefix cache: only the toy's worker saw prompts
        queried = {w: dep.stats(w).prefix_cache_query_tokens for w in dep.decode}
        last = max(dep.decode)
        assert queried[last] >= sum(map(len, prompts)) and all(v == 0 for w, v in queried.items() if w != last)
    finally:
        dep.stop()
