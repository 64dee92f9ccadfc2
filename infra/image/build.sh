#!/usr/bin/env bash
# Build the image the manifests in infra/k8s name (ghcr.io/spotrain/spotrain:0.1.0) from the
# repository's Dockerfile without a container daemon, and check that it runs:
#
#   1. a base image from Debian's packages: mmdebstrap (bookworm, minbase, Debian's python3
#      with venv) -> a rootfs tarball -> one layer committed with buildah;
#   2. `buildah bud` of the Dockerfile on that base (chroot isolation: no runc, no daemon),
#      PYTHON_IMAGE pointing at it by digest;
#   3. the image written as an OCI layout, its rootfs unpacked with umoci, its command run in a
#      chroot as the image's user, from its working directory, with its environment:
#      `spotrain --help` and the operator's `--help` must answer.
#
# Needs root (mmdebstrap's root mode, buildah's chroot isolation, chroot) and
#   apt-get install mmdebstrap buildah umoci skopeo
# Usage: bash infra/image/build.sh [OUT]   (OUT: where the OCI layout and rootfs go)
# Environment:
#   TORCH_INDEX     passed as the Dockerfile's build argument (unset: its default, PyTorch's
#                   CPU index; empty: pip's own index, whose Linux x86-64 torch is the CUDA one)
#   TORCH_VARIANT   likewise (cpu, cu126, cu128)
#   SPOTRAIN_IMAGE_CA  a CA bundle the build's RUN steps must trust (an egress proxy that
#                   re-signs TLS); bind-mounted for the build only, never put in the image
#   SPOTRAIN_IMAGE_WORK  buildah's storage and the base tarball (default ~/.cache/spotrain/image)
#   STORAGE_DRIVER  overlay (default) or vfs where overlay mounts are refused
#   SPOTRAIN_IMAGE_SOURCES  the base's apt sources (default: this Debian machine's deb822 file)
set -euo pipefail
cd "$(dirname "$0")/../.."
work=${SPOTRAIN_IMAGE_WORK:-$HOME/.cache/spotrain/image}
out=$(realpath -m "${1:-$work/out}")
tag=ghcr.io/spotrain/spotrain:0.1.0
base=localhost/spotrain-base:bookworm
mkdir -p "$work" "$out"
B=(buildah --root "$work/storage" --runroot "$work/run" --storage-driver "${STORAGE_DRIVER:-overlay}")

# 1. the base, from Debian's packages (kept: rebuilt only when its tarball is removed)
if [[ ! -s $work/base.tar ]]; then
  # the machine's own Debian sources (bookworm, its updates and security), as apt uses them
  mmdebstrap --mode=root --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$work/base.tar.part" "${SPOTRAIN_IMAGE_SOURCES:-/etc/apt/sources.list.d/debian.sources}"
  mv "$work/base.tar.part" "$work/base.tar"
  "${B[@]}" rmi -f "$base" >/dev/null 2>&1 || true
fi
if ! "${B[@]}" inspect --type image "$base" >/dev/null 2>&1; then
  ctr=$("${B[@]}" from scratch)
  "${B[@]}" add "$ctr" "$work/base.tar" /
  "${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd '["python3"]' "$ctr"
  "${B[@]}" commit --rm -q "$ctr" "$base" >/dev/null
fi
base_digest=$("${B[@]}" inspect --type image --format '{{.FromImageDigest}}' "$base")
echo "base $base@$base_digest"

# 2. the Dockerfile, as written, on that base
args=(--build-arg "PYTHON_IMAGE=$base@$base_digest")
[[ -v TORCH_INDEX ]] && args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
[[ -v TORCH_VARIANT ]] && args+=(--build-arg "TORCH_VARIANT=$TORCH_VARIANT")
if [[ -n ${SPOTRAIN_IMAGE_CA:-} ]]; then
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$work/pip.conf"
  args+=(-v "$(realpath "$SPOTRAIN_IMAGE_CA"):/etc/ssl/certs/ca-certificates.crt:ro")
  args+=(-v "$work/pip.conf:/etc/pip.conf:ro")
fi
"${B[@]}" bud --isolation chroot --layers "${args[@]}" -t "$tag" -f Dockerfile .
digest=$("${B[@]}" inspect --type image --format '{{.FromImageDigest}}' "$tag")
echo "image $tag@$digest"

# 3. an OCI layout, unpacked, its command run as the image says
rm -rf "$out/oci" "$out/rootfs"
"${B[@]}" push -q "$tag" "oci:$out/oci:0.1.0"
skopeo inspect --config "oci:$out/oci:0.1.0" >"$out/config.json"
# (raw: the rootfs alone; a full unpack also hashes every file for an mtree, 3x slower)
umoci raw unpack --image "$out/oci:0.1.0" "$out/rootfs"
read -r user workdir cmd < <(python3 - "$out/config.json" <<'EOF'
import json, shlex, sys
c = json.load(open(sys.argv[1]))["config"]
print(c["User"], c["WorkingDir"], shlex.join((c.get("Entrypoint") or []) + (c.get("Cmd") or [])))
EOF
)
mapfile -t env < <(python3 -c 'import json,sys; print(*json.load(open(sys.argv[1]))["config"]["Env"], sep="\n")' "$out/config.json")
run() {  # a command in the image's rootfs, as its user, in its working directory
  chroot --userspec="$user" "$out/rootfs" /usr/bin/env -i "${env[@]}" \
    /bin/sh -c "cd '$workdir' && exec $*"
}
run "$cmd" | tee "$out/help.txt" | head -n 3
grep -q "usage: spotrain" "$out/help.txt"
run python -m spotrain.workers.k8s.operator --help | grep -q -- "--task-queue"
run id -u | grep -qx "${user%%:*}"
echo "ran as uid ${user%%:*} in $workdir: '$cmd' and the operator's --help; OCI layout in $out/oci"
