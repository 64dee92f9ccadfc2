"""The Dockerfile, without building the image (infra/image/build.sh builds it daemonless with
buildah, but its torch layer takes 26-39 minutes here, beyond the suite's budget): its shape
is checked (multi-stage, a pinned base, non-root as the manifests expect, the torch variant a
build argument), and its install step runs for real on exactly the files its build stage
copies: the wheel built from that context installs, and the console script and the operator
start from it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def stages() -> list[list[str]]:
    found: list[list[str]] = []
    for line in DOCKERFILE.splitlines():
        if line.startswith("FROM "):
            found.append([])
        if found and line and not line.startswith("#"):
            found[-1].append(line)
    return found


def test_multi_stage_pinned_non_root_with_a_torch_variant() -> None:
    build, final = stages()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, re.M)
    assert base and re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", base[1])
    assert build[0] == "FROM ${PYTHON_IMAGE} AS build" and final[0] == "FROM ${PYTHON_IMAGE}"
    assert any("download.pytorch.org/whl/${TORCH_VARIANT}" in line for line in build)
    assert not any("pip install" in line for line in final)  # nothing built in the final stage
    user = next(line for line in final if line.startswith("USER "))
    uid = int(user.split()[1].split(":")[0])
    assert uid != 0
    for doc in yaml.safe_load_all((ROOT / "infra/k8s/operator.yaml").read_text()):
        assert doc["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid


def test_install_step_on_the_copied_files(tmp_path: Path) -> None:
    """Only what `COPY ... /src` brings: a file the package needs outside it fails here."""
    src = tmp_path / "src"
    src.mkdir()
    for line in stages()[0]:
        if line.startswith("COPY ") and "--from" not in line:
            *paths, dest = line.split()[1:]
            for p in paths:
                target = src / Path(dest).relative_to("/src") if dest != "/src/" else src / p
                copy = shutil.copytree if (ROOT / p).is_dir() else shutil.copy
                copy(ROOT / p, target)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    if int(version("setuptools").split(".")[0]) >= 77:  # the build's own (pyproject.toml)
        pip.append("--no-build-isolation")  # else pip fetches it, as `docker build` does
    subprocess.run([*pip, "--target", str(site), str(src)], check=True, timeout=240)
    check = (
        "import spotrain.workers.k8s.operator as o, spotrain.workers.k8s.crd as c;"
        "import spotrain.elastic;"
        f"assert o.__file__.startswith({str(site)!r}), o.__file__; print(len(c.render()))"
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and int(done.stdout) > 1000, done.stderr
    help_ = subprocess.run(
        [sys.executable, "-m", "spotrain.workers.k8s.operator", "--help"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "--task-queue" in help_.stdout, help_.stderr
    assert (site / "bin/spotrain").exists()  # the console script the manifests run


def test_the_daemonless_build_makes_the_image_the_manifests_name() -> None:
    """infra/image/build.sh (buildah on a Debian base; too slow for the suite: it installs
    torch, minutes and gigabytes) builds this Dockerfile under the tag every manifest runs."""
    script = (ROOT / "infra/image/build.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "infra/image/build.sh")], check=True)
    tag = re.search(r"^tag=(\S+)$", script, re.M)
    assert tag and "-f Dockerfile" in script and "--isolation chroot" in script
    named = set()
    for manifest in ("operator", "worker", "webhook"):
        for doc in yaml.safe_load_all((ROOT / f"infra/k8s/{manifest}.yaml").read_text()):
            if doc and doc.get("kind") == "Deployment":
                named |= {c["image"] for c in doc["spec"]["template"]["spec"]["containers"]}
    assert named == {tag[1]}
