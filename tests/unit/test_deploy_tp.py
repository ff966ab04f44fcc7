"""The tensor-parallel overlay (deploy/k8s/overlays/gpu-tp), rendered: decode pods of 2 GPUs run
one worker of 2 ranks (``--tensor-parallel-size=2``, role both), the prefill Deployment is scaled
to 0 and the router places no prefill elsewhere. The overlay is also in deploy_render.OVERLAYS,
so every invariant the other manifests keep is checked on it too."""
from __future__ import annotations

from deploy_render import configmap, deployments, flag, main_container, render, resolved_args

from pdserve import cli
from pdserve.common.serving.worker_args import engine_config_from_args


def test_gpu_tp_overlay(renderer):
    objs = render(renderer, "gpu-tp")
    deps = deployments(objs)
    decode = main_container(deps["decode"])
    assert str(decode["resources"]["limits"]["nvidia.com/gpu"]) == "2"
    args = resolved_args(decode, objs)
    assert flag(args, "tensor-parallel-size") == "2" and flag(args, "role") == "both"
    assert flag(args, "device") == "cuda"
    parsed = cli.build_parser().parse_args(args)         # the worker's own parser takes them
    assert engine_config_from_args(parsed, parsed.role).tensor_parallel_size == 2
    assert deps["prefill"]["spec"]["replicas"] == 0
    assert str(main_container(deps["prefill"])["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert configmap(objs)["data"]["PDSERVE_ROUTER_PD_POLICY"] == "never"
    assert "nvidia.com/gpu" not in main_container(deps["router"]).get("resources", {}).get("limits", {})
