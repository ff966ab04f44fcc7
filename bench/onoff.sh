# Sourced by the one-call GPU scripts (bench/gpu_dataflow.sh, bench/gpu_wide.sh).
# onoff VAR TITLE PATTERN CMD...: CMD in two rounds with VAR=0 then VAR=1 in each, so that drift
# hits both settings alike; a literal {f} in CMD becomes the setting and {r} the round (use them in
# output file names); of CMD's output only the lines matching the grep -E PATTERN are shown.
onoff() {
  local var=$1 title=$2 pattern=$3 r f
  shift 3
  for r in 1 2; do
    for f in 0 1; do
      echo "== $title, $var=$f, round $r"
      local args=("${@//\{f\}/$f}")
      env "$var=$f" "${args[@]//\{r\}/$r}" 2>&1 | grep -E "$pattern"
    done
  done
}
