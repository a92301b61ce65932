#!/usr/bin/env bash
# The engine and kernels of past commits, for bench/shared_prefix.py --tree on the GPU machine
# (which has no git): run here, in a checkout, before the call that carries .whl/ (git
# ignores it). bench/round3.py --prefix runs the shared-prefix workload on each tree under
# .whl/trees after this checkout's own.
#   bash bench/old_trees.sh [COMMIT...]
# Default commits: the ends of the sessions between the shared-prefix figures of issue 28
# (19,219 tok/s, then 17,516): before piecewise graphs (12-01, first session); piecewise
# graphs and a wait of 4 (second); the KV budget counting the graphs and token ids in arrays
# (third); O(1) admission (12-02, first). Later sessions left engine/ as the last of these
# (and kernels/ but for the CPU path) until the rename to pagedq.*, which this checkout has.
set -eu
commits=${*:-c9f342f 7c596f1 52ce223 903b560}
dest=.whl/trees
mkdir -p "$dest"
for c in $commits; do
  sha=$(git rev-parse --short "$c^{commit}")
  out="$dest/$(git log -1 --format=%ad --date=format:%m%d-%H%M "$sha")-$sha"  # sorts by date
  rm -rf "${out:?}"
  mkdir -p "$out"
  # an old tree imports `engine` and `kernels` (top level); a later one `pagedq.*`
  if git cat-file -e "$sha:pagedq/__init__.py" 2>/dev/null; then
    git archive "$sha" engine kernels pagedq pyproject.toml | tar -x -C "$out"
  else
    git archive "$sha" engine kernels | tar -x -C "$out"
  fi
  echo "$out: $(git log -1 --format=%s "$sha" | cut -c1-80)"
done
du -sh "$dest"
