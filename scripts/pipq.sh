# Sourced by the set-up scripts. `pipq PIP_COMMAND...` runs pip quietly: drops pip's harmless "WARNING: Location"
# lines and keeps everything else, and returns pip's own exit status, so that a failed install stops set-up with
# pip's error instead of failing later with an unrelated message.
pipq() {
  "$@" -q --disable-pip-version-check 2>&1 | { grep -v "^WARNING: Location" || true; }
  return "${PIPESTATUS[0]}"
}

# `ensure_venv PYTHON DIR`: a virtual environment in DIR with pip. A run interrupted while creating it leaves a DIR
# with python but without pip, which `[ -x DIR/bin/python ]` took for done; venv over it installs what is missing.
ensure_venv() {
  [ -x "$2/bin/pip" ] || "$1" -m venv "$2"
}
