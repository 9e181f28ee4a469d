#!/usr/bin/env bash
# Does the GPU dependency set install? Asks pip's resolver, from any machine (no GPU needed), whether
# requirements/gpu.txt resolves for the GPU machines: Linux x86_64, CPython 3.12, glibc >= 2.34.
#
#   launch/check_gpu_deps.sh [REQ_FILE [TE_FILE]]   # defaults: requirements/gpu.txt requirements/gpu-te.txt
#
# Exit 0 = resolves; 1 = does not (pip's conflict report is printed); 2 = could not check (no index,
# tool venv failed, bad arguments).
#
# Metadata only: pip runs with --dry-run and --use-feature=fast-deps, so it reads each wheel's METADATA
# through HTTP range requests (the index serves no PEP 658 .metadata files) and returns before
# downloading any wheel. Measured here: about 2 minutes and under 100 MB of traffic for ~240 packages,
# instead of several GB of CUDA wheels. That relies on pip's --dry-run returning before the final
# download (older pips, e.g. 23.2, download every wheel after resolving), so the check runs a pinned pip
# in its own small venv ($QARL_DEPCHECK_VENV, default ~/.cache/qarl/venv-depcheck).
#
# TransformerEngine's PyTorch extension (TE_FILE, step 2 of the GPU install) exists only as an sdist,
# which the resolver cannot build for another Python and platform. The check reads that sdist instead
# (a few hundred kB): no wheel of it on the index, its declared torch range admits the GPU torch pin, its
# build needs torch (hence --no-build-isolation), and its other requirements go into the resolve.
#
# Variables: QARL_GPU_PYTHON (3.12), QARL_GPU_GLIBC (2.34: the newest manylinux_2_N tag accepted),
# QARL_DEPCHECK_REPORT (where pip's JSON report goes; default a temp dir that is removed).
set -euo pipefail
QARL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ="${1:-$QARL_ROOT/requirements/gpu.txt}"
TE_REQ="${2:-$QARL_ROOT/requirements/gpu-te.txt}"
GPU_PY="${QARL_GPU_PYTHON:-3.12}"
GLIBC="${QARL_GPU_GLIBC:-2.34}"
TOOL_PIP="pip==26.3"
TVENV="${QARL_DEPCHECK_VENV:-$HOME/.cache/qarl/venv-depcheck}"
PY="${PYTHON:-python3}"

die2() { echo "check_gpu_deps: cannot check: $*" >&2; exit 2; }
[ -f "$REQ" ] || die2 "no requirements file $REQ"
[ "$TE_REQ" = "-" ] || [ -f "$TE_REQ" ] || die2 "no requirements file $TE_REQ"
[[ "$GLIBC" =~ ^2\.([0-9]+)$ ]] || die2 "QARL_GPU_GLIBC must look like 2.34"
glibc_minor="${BASH_REMATCH[1]}"
start=$SECONDS

# --- the tool venv: a pinned pip and nothing else ---
stamp="$TVENV/.qarl-depcheck-$TOOL_PIP"
if [ ! -f "$stamp" ]; then
  { [ -x "$TVENV/bin/python" ] || "$PY" -m venv "$TVENV"; } || die2 "could not create $TVENV"
  "$TVENV/bin/python" -m pip install -q --disable-pip-version-check "$TOOL_PIP" >"$TVENV/.pip-install.log" 2>&1 \
    || { cat "$TVENV/.pip-install.log" >&2; die2 "could not install $TOOL_PIP into $TVENV"; }
  touch "$stamp"
fi
TPY="$TVENV/bin/python"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
REPORT="${QARL_DEPCHECK_REPORT:-$work/report.json}"

# pip matches manylinux_2_N tags exactly: name every one up to the GPU machines' glibc.
plats=()
for ((n = glibc_minor; n >= 5; n--)); do plats+=(--platform "manylinux_2_${n}_x86_64"); done
plats+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
plats+=(--platform linux_x86_64)

# --- TransformerEngine's PyTorch extension: read its sdist ---
extra_reqs=()
if [ "$TE_REQ" != "-" ]; then
  index="${PIP_INDEX_URL:-$("$TPY" -m pip config get global.index-url 2>/dev/null || true)}"
  index="${index:-https://pypi.org/simple}"
  set +e
  "$TPY" - "$REQ" "$TE_REQ" "$index" "$GPU_PY" "$work/te-deps.txt" <<'PYEOF'
import hashlib, io, os, re, ssl, sys, tarfile, tomllib, urllib.parse, urllib.request
from html.parser import HTMLParser
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from pip._vendor.packaging.version import Version

req_file, te_file, index, gpu_py, deps_out = sys.argv[1:]

def pins(path):
    out = {}
    for line in open(path):
        line = re.sub(r"(^|\s)#.*", "", line).strip()
        if line and not line.startswith("-"):
            r = Requirement(line)
            spec = [s for s in r.specifier if s.operator == "=="]
            out[canonicalize_name(r.name)] = Version(spec[0].version) if spec else None
    return out

def fail(msg, code=1):
    print(f"check_gpu_deps: {msg}", file=sys.stderr)
    sys.exit(code)

gpu, te = pins(req_file), pins(te_file)
name = canonicalize_name("transformer-engine-torch")
if te.get(name) is None:
    fail(f"{te_file} must pin transformer-engine-torch==VERSION", 2)
te_version = te[name]
torch_pin = gpu.get("torch")
if torch_pin is None:
    fail(f"{req_file} must pin torch==VERSION", 2)
core_pin = gpu.get(canonicalize_name("transformer-engine"))
if core_pin is not None and core_pin != te_version:
    fail(f"transformer-engine=={core_pin} in {req_file} but transformer-engine-torch=={te_version} in {te_file}")

cafile = os.environ.get("PIP_CERT") or None
ctx = ssl.create_default_context(cafile=cafile)

class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links = []
    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.links.append(dict(attrs).get("href", ""))

page_url = index.rstrip("/") + "/transformer-engine-torch/"
try:
    with urllib.request.urlopen(page_url, context=ctx, timeout=120) as resp:
        parser = Links()
        parser.feed(resp.read().decode("utf-8", "replace"))
except OSError as e:
    fail(f"cannot read {page_url}: {e}", 2)

py_tag = "cp" + gpu_py.replace(".", "")
sdist_url = None
wheels = []
for href in parser.links:
    url = urllib.parse.urljoin(page_url, href)
    fname = urllib.parse.unquote(url.split("#")[0].rsplit("/", 1)[-1])
    if fname.endswith(".whl"):
        _, ver, _, tags = parse_wheel_filename(fname)
        if ver == te_version and any(
            t.interpreter in (py_tag, "py3") and "x86_64" in t.platform and "linux" in t.platform for t in tags
        ):
            wheels.append(fname)
    elif fname.endswith(".tar.gz"):
        _, ver = parse_sdist_filename(fname)
        if ver == te_version:
            sdist_url = url
if wheels:
    print(f"transformer-engine-torch {te_version}: a wheel for {py_tag} Linux x86_64 exists ({wheels[0]}); "
          "the two-step install in requirements/gpu-te.txt is no longer needed")
if sdist_url is None:
    fail(f"transformer-engine-torch {te_version}: no sdist on {page_url}")

with urllib.request.urlopen(sdist_url.split("#")[0], context=ctx, timeout=300) as resp:
    blob = resp.read()
frag = urllib.parse.urlparse(sdist_url).fragment
if frag.startswith("sha256=") and hashlib.sha256(blob).hexdigest() != frag[len("sha256="):]:
    fail(f"sha256 mismatch for {sdist_url}", 2)
with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
    def member(suffix):
        m = [x for x in tar.getmembers() if x.name.count("/") == 1 and x.name.endswith("/" + suffix)]
        return tar.extractfile(m[0]).read().decode() if m else ""
    pkg_info, pyproject = member("PKG-INFO"), member("pyproject.toml")

requires = [Requirement(l.split(":", 1)[1].strip()) for l in pkg_info.splitlines() if l.startswith("Requires-Dist:")]
torch_reqs = [r for r in requires if canonicalize_name(r.name) == "torch"]
if not torch_reqs or not all(r.specifier.contains(torch_pin, prereleases=True) for r in torch_reqs):
    fail(f"transformer-engine-torch {te_version} declares {[str(r) for r in torch_reqs]}, which excludes torch {torch_pin}")
build_requires = tomllib.loads(pyproject).get("build-system", {}).get("requires", []) if pyproject else []
builds_with_torch = any(canonicalize_name(Requirement(b).name) == "torch" for b in build_requires)
# transformer_engine_cuNN==VERSION is chosen at build time from torch.version.cuda (the sdist's PKG-INFO
# says cu12); the core library the GPU set installs is checked against the report below.
deps = [r for r in requires if not canonicalize_name(r.name).startswith("transformer-engine-cu")
        and canonicalize_name(r.name) != "torch"]
with open(deps_out, "w") as f:
    f.write("".join(f"{r}\n" for r in deps))
print(f"transformer-engine-torch {te_version}: sdist only on the index ({len(blob) // 1024} kB read); "
      f"declares {', '.join(str(r) for r in torch_reqs)} (admits torch {torch_pin}); "
      + ("its build imports torch: install it with --no-build-isolation after the GPU set; "
         if builds_with_torch else "")
      + f"its other requirements join the resolve: {', '.join(str(r) for r in deps) or 'none'}")
PYEOF
  rc=$?
  set -e
  [ "$rc" -eq 0 ] || exit "$rc"
  extra_reqs=(-r "$work/te-deps.txt")
fi

# --- the resolve ---
echo "resolving $(realpath --relative-to="$PWD" "$REQ" 2>/dev/null || echo "$REQ") for CPython $GPU_PY, Linux x86_64, glibc <= $GLIBC (metadata only) ..."
set +e
"$TPY" -m pip install --disable-pip-version-check --dry-run --ignore-installed \
  --use-feature=fast-deps --report "$REPORT" \
  --python-version "$GPU_PY" --implementation cp "${plats[@]}" --only-binary=:all: \
  --target "$work/target" -r "$REQ" "${extra_reqs[@]}" >"$work/pip.log" 2>&1
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  grep -v -e "is ignored: it is neither a file nor a directory" -e "fast-deps" "$work/pip.log" | tail -40 >&2
  echo "check_gpu_deps: FAIL: pip's resolver rejects $REQ for CPython $GPU_PY / Linux x86_64 (pip exit $rc, $((SECONDS - start)) s)" >&2
  exit 1
fi

# --- what it chose ---
"$TPY" - "$REPORT" "$TE_REQ" <<'PYEOF'
import json, re, sys
from pip._vendor.packaging.utils import canonicalize_name
report, te_file = sys.argv[1:]
chosen = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in json.load(open(report))["install"]}
key = ["torch", "triton", "torchvision", "torchaudio", "sglang", "sglang-kernel", "flashinfer-python",
       "transformers", "compressed-tensors", "numpy", "megatron-core", "transformer-engine",
       "transformer-engine-cu12", "transformer-engine-cu13", "onnx", "onnxscript"]
print(f"resolved {len(chosen)} packages; " + ", ".join(f"{k} {chosen[k]}" for k in key if k in chosen))
if te_file != "-":
    te_version = next(l.split("==")[1].split()[0] for l in open(te_file) if l.startswith("transformer-engine-torch=="))
    # The extension's setup.py picks transformer_engine_cuNN from the CUDA major of the torch it builds with.
    cuda = chosen.get("nvidia-cuda-runtime", "").split(".")[0]
    core = chosen.get(f"transformer-engine-cu{cuda}")
    if core != te_version:
        print(f"check_gpu_deps: FAIL: transformer-engine-torch {te_version}, built against this torch (CUDA "
              f"{cuda or '?'}), needs transformer-engine-cu{cuda or 'NN'}=={te_version}; the GPU set gives {core}",
              file=sys.stderr)
        sys.exit(1)
PYEOF
echo "check_gpu_deps: OK: pip's resolver accepts the GPU set ($((SECONDS - start)) s; wheels read through range requests, none downloaded whole)"
