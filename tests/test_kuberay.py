"""deploy/kuberay: the manifests are well-formed, use only KubeRay's RayService / RayCluster fields, give each
engine replica the GPUs its TP size needs, and probe /health. The embedded Serve config runs on a local Ray in
tests/test_serve_replicas.py (the autoscaling test), which shares that module's Ray and Serve."""

from __future__ import annotations

import os

import yaml

from engine.serve_replicas.config import ReplicaAppConfig

ROOT = os.path.join(os.path.dirname(__file__), "..", "deploy", "kuberay")

# KubeRay v1 API (ray.io/v1, operator 1.3): the fields these kinds define (a typo is silently ignored by the
# operator, so the test refuses anything else).
RAYSERVICE_SPEC = {"serveConfigV2", "rayClusterConfig", "upgradeStrategy", "serveService", "excludeHeadPodFromServeSvc",
                   "rayClusterDeletionDelaySeconds", "managedBy"}
RAYCLUSTER_SPEC = {"rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec", "workerGroupSpecs",
                   "headServiceAnnotations", "suspend", "managedBy", "gcsFaultToleranceOptions"}
HEAD_GROUP = {"rayStartParams", "template", "serviceType", "headService", "enableIngress"}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "rayStartParams", "template",
                "scaleStrategy", "suspend", "idleTimeoutSeconds"}


def load(name: str) -> list[dict]:
    with open(os.path.join(ROOT, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def check_cluster(spec: dict, gpus_per_engine: int) -> None:
    assert set(spec) <= RAYCLUSTER_SPEC, set(spec) - RAYCLUSTER_SPEC
    assert spec["rayVersion"] == "2.60.0"  # the Dockerfile's base image
    head = spec["headGroupSpec"]
    assert set(head) <= HEAD_GROUP and head["rayStartParams"]["num-gpus"] == "0"
    for group in spec["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP, set(group) - WORKER_GROUP
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        for k, v in group["rayStartParams"].items():
            assert isinstance(v, str), f"rayStartParams.{k} must be a string"
        (c,) = group["template"]["spec"]["containers"]
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        assert req["nvidia.com/gpu"] == lim["nvidia.com/gpu"] == group["rayStartParams"]["num-gpus"]
        assert int(lim["nvidia.com/gpu"]) == gpus_per_engine, "each GPU pod holds exactly one engine replica"
    for c in [*head["template"]["spec"]["containers"],
              *(c for g in spec["workerGroupSpecs"] for c in g["template"]["spec"]["containers"])]:
        assert c["image"] and c["resources"]["limits"]["memory"]


def test_rayservice_is_kuberay_shaped_and_its_gpus_match_the_engines_tp_size():
    docs = load("rayservice.yaml")
    svc = next(d for d in docs if d["kind"] == "RayService")
    assert svc["apiVersion"] == "ray.io/v1" and set(svc["spec"]) <= RAYSERVICE_SPEC
    serve_cfg = yaml.safe_load(svc["spec"]["serveConfigV2"])
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_cfg)  # Serve's own schema for a config file
    (app,) = serve_cfg["applications"]
    assert app["import_path"] == "engine.serve_replicas.app:build_app"
    cfg = ReplicaAppConfig.from_dict(app["args"])  # every arg is a known field
    draft_tp = dict(cfg.engine.speculative_config or {}).get("draft_tensor_parallel_size", 1)
    check_cluster(svc["spec"]["rayClusterConfig"], cfg.engine.tensor_parallel_size + draft_tp)
    cluster = svc["spec"]["rayClusterConfig"]
    assert cfg.max_replicas <= sum(g["maxReplicas"] for g in cluster["workerGroupSpecs"])  # room to scale
    head = cluster["headGroupSpec"]
    assert "specserve_job_store" in head["rayStartParams"]["resources"] and cfg.ingress_resources
    mounts = {m["mountPath"] for m in head["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert os.path.dirname(cfg.data_dir) in mounts  # the job store is on the head's persistent volume
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert "specserve-jobs" in claims
    for g in cluster["workerGroupSpecs"]:
        (c,) = g["template"]["spec"]["containers"]
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert any(e["name"] == "SPECSERVE_API_KEY" for e in c["env"])  # off loopback: a key is required


def test_raycluster_for_batch_jobs_holds_one_engine_per_gpu_pod():
    (rc,) = load("raycluster.yaml")
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    ann = rc["metadata"]["annotations"]
    check_cluster(rc["spec"], int(ann["specserve.io/tensor-parallel-size"])
                  + int(ann["specserve.io/draft-tensor-parallel-size"]))


def test_dockerfile_installs_the_cuda_torch_before_the_package_and_matches_the_ray_version():
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = f.read()
    assert "rayproject/ray:2.60.0-" in text
    torch_at, package_at = text.index("torch==2.13.0 --index-url"), text.index("pip install --no-cache-dir .")
    assert torch_at < package_at
