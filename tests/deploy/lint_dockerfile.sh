#!/usr/bin/env bash
# A small Dockerfile linter for deploy/docker/Dockerfile (hadolint is not
# packaged for Debian 12 and no Docker engine runs here). It checks the rules
# this image is held to, and that it fails on a Dockerfile breaking them.
#   lint_dockerfile.sh <Dockerfile> <deps.sh>
set -euo pipefail
dockerfile="$1"
deps="$2"

lint() {  # Dockerfile -> problems on stdout, one per line
  local f="$1"
  # Join continuation lines so each instruction is one line; drop comments.
  local text
  text="$(sed -e 's/[[:space:]]*#.*$//' -e '/^[[:space:]]*$/d' "$f" | sed -e ':a' -e '/\\$/N; s/\\\n/ /; ta')"
  local froms
  froms="$(grep -ciE '^FROM[[:space:]]' <<<"$text" || true)"
  ((froms >= 2)) || echo "not multi-stage ($froms FROM)"
  # Every base is pinned: a tag other than latest, or a digest. ARG defaults
  # used in FROM are resolved first.
  while read -r _ image _; do
    if [[ "$image" =~ ^\$\{?([A-Za-z_]+)\}?$ ]]; then
      image="$(grep -iE "^ARG[[:space:]]+${BASH_REMATCH[1]}=" <<<"$text" | head -1 | sed -E 's/^[^=]*=//')"
    fi
    grep -qxiE 'builder' <<<"$image" && continue  # a previous stage
    if [[ "$image" != *@sha256:* ]]; then
      [[ "$image" == *:* && "$image" != *:latest ]] || echo "unpinned base image '$image'"
    fi
    [[ -z "$image" || "$image" == debian:12* || "$image" == *debian:12* ]] \
      || echo "base image '$image' is not Debian 12"
  done < <(grep -iE '^FROM[[:space:]]' <<<"$text")
  # The last USER is non-root (a name other than root or a uid other than 0).
  local user
  user="$(grep -iE '^USER[[:space:]]' <<<"$text" | tail -1 | awk '{print $2}')"
  [[ -n "$user" && "${user%%:*}" != root && "${user%%:*}" != 0 ]] \
    || echo "final USER is root or missing ('$user')"
  # The final USER comes after the last FROM (it applies to the runtime stage).
  local last_from last_user
  last_from="$(grep -niE '^FROM[[:space:]]' <<<"$text" | tail -1 | cut -d: -f1)"
  last_user="$(grep -niE '^USER[[:space:]]' <<<"$text" | tail -1 | cut -d: -f1)"
  [[ -n "$last_user" && "$last_user" -gt "$last_from" ]] || echo "no USER in the final stage"
  # No ADD of URLs (or at all: COPY is explicit).
  grep -iE '^ADD[[:space:]]' <<<"$text" | grep -qiE 'https?://|ftp://' && echo "ADD of a URL"
  grep -qiE '^ADD[[:space:]]' <<<"$text" && echo "ADD instead of COPY"
  # Every RUN that runs apt-get install also cleans the lists, skips
  # recommends and says -y; no apt-get upgrade; no curl | sh.
  while read -r run; do
    if grep -qE 'apt-get (-[a-z]+ )*install' <<<"$run"; then
      grep -q -- '--no-install-recommends' <<<"$run" || echo "apt-get install without --no-install-recommends"
      grep -qE '(^| )-y( |$)|--yes' <<<"$run" || echo "apt-get install without -y"
      grep -q 'rm -rf /var/lib/apt/lists' <<<"$run" || echo "apt lists not cleaned in the same RUN"
    fi
    if grep -q 'canzona_install_deps' <<<"$run"; then
      grep -q 'rm -rf /var/lib/apt/lists' <<<"$run" || echo "apt lists not cleaned after canzona_install_deps"
    fi
    grep -qE 'apt-get (dist-)?upgrade' <<<"$run" && echo "apt-get upgrade"
    grep -qE '(curl|wget)[^|]*\|[[:space:]]*(ba)?sh' <<<"$run" && echo "pipes a download into a shell"
  done < <(grep -iE '^RUN[[:space:]]' <<<"$text")
  # Image contract: ENTRYPOINT canzonad (exec form), ports, no HEALTHCHECK.
  grep -qE '^ENTRYPOINT[[:space:]]+\[".*canzonad"\]' <<<"$text" || echo "ENTRYPOINT is not canzonad in exec form"
  grep -qE '^EXPOSE .*\b7070\b' <<<"$text" || echo "7070 not exposed"
  grep -qE '^EXPOSE .*\b9464\b' <<<"$text" || echo "9464 not exposed"
  grep -qxE 'HEALTHCHECK[[:space:]]+NONE' <<<"$text" || echo "HEALTHCHECK is not NONE"
  # The builder installs what deps.sh lists (one source of truth).
  grep -q 'deploy/lib/deps.sh' <<<"$text" || echo "builder does not use deploy/lib/deps.sh"
  return 0
}

problems="$(lint "$dockerfile")"
if [[ -n "$problems" ]]; then
  echo "FAIL: $dockerfile:"; sed 's/^/  /' <<<"$problems"; exit 1
fi
echo "lint: $dockerfile clean"
[[ -f "$deps" ]] && grep -q CANZONA_DEBIAN_PACKAGES "$deps" || { echo "FAIL: $deps"; exit 1; }

# The linter can fail: a Dockerfile breaking each rule.
bad="$(mktemp)"
trap 'rm -f "$bad"' EXIT
cat >"$bad" <<'BAD'
FROM debian:latest
ADD https://example.com/x.tar.gz /x
RUN apt-get update && apt-get install curl
RUN curl -s https://example.com/i.sh | sh
USER root
ENTRYPOINT canzonad
BAD
problems="$(lint "$bad")"
for expected in "not multi-stage" "unpinned base" "final USER is root" "ADD of a URL" \
    "without --no-install-recommends" "without -y" "apt lists not cleaned" \
    "pipes a download" "ENTRYPOINT" "HEALTHCHECK"; do
  grep -q "$expected" <<<"$problems" || { echo "FAIL: the linter missed '$expected' in:"; echo "$problems"; exit 1; }
done
echo "lint: flags a bad Dockerfile ($(wc -l <<<"$problems") problems)"
echo PASS
