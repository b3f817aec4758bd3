# bash completion for steptrace (the CLI) and steptraced (the daemon): subcommands, their
# flags, the values of top --sort, --log-level and --nvml, and file names after -o/--output,
# --socket and --config (directories after --state-dir).
#
# The package installs this file as /usr/share/bash-completion/completions/steptrace and
# .../steptraced, where bash-completion loads it the first time either command is
# completed. It needs nothing but bash's own `complete` and `compgen`, so without
# bash-completion `source` it (e.g. from ~/.bashrc).
#
# Keep the words below in step with `steptrace help SUBCOMMAND` and `steptraced --help`:
# tests/packaging/completion_test.py compares them.

# COMPREPLY = the words of $1 that start with $2.
_steptrace_words() {
  local IFS=$' \t\n'
  mapfile -t COMPREPLY < <(compgen -W "$1" -- "$2")
}

# COMPREPLY = file names (with -d: directory names) that start with the last argument.
_steptrace_paths() {
  local kind=-f
  if [[ $1 == -d ]]; then
    kind=-d
    shift
  fi
  compopt -o filenames 2>/dev/null
  mapfile -t COMPREPLY < <(compgen "$kind" -- "$1")
}

# Sets cur and prev from COMP_WORDS, joining `--opt=value` (bash splits at the '=').
_steptrace_current() {
  cur=${COMP_WORDS[COMP_CWORD]}
  prev=""
  ((COMP_CWORD > 0)) && prev=${COMP_WORDS[COMP_CWORD - 1]}
  if [[ $cur == "=" ]]; then
    cur=""
  elif [[ $prev == "=" ]] && ((COMP_CWORD > 1)); then
    prev=${COMP_WORDS[COMP_CWORD - 2]}
  fi
}

_steptrace() {
  local cur prev
  _steptrace_current
  COMPREPLY=()
  local global="--socket --timeout --help --version"
  local subcommands="ping report ledger stats metrics reset version top trace help"

  case $prev in
    --socket | -o | --output)
      _steptrace_paths "$cur"
      return
      ;;
    --timeout | --pid | --gpu | --interval | --iterations | --last | --for | --job | --compute | --overhead)
      return # a number, a UUID, a job id or step names: nothing to offer
      ;;
    --sort)
      _steptrace_words "time name pid" "$cur"
      return
      ;;
  esac

  # The subcommand: the first word that is neither an option nor a global option's value.
  local i sub="" sub_at=0
  for ((i = 1; i < COMP_CWORD; i++)); do
    case ${COMP_WORDS[i]} in
      --socket | --timeout)
        [[ ${COMP_WORDS[i + 1]} == "=" ]] && ((i++))
        ((i++))
        ;;
      -*) ;;
      =) ((i++)) ;;
      *)
        sub=${COMP_WORDS[i]}
        sub_at=$i
        break
        ;;
    esac
  done

  if [[ -z $sub ]]; then
    if [[ $cur == -* ]]; then
      _steptrace_words "$global" "$cur"
    else
      _steptrace_words "$subcommands" "$cur"
    fi
    return
  fi

  local flags=""
  case $sub in
    report) flags="--json --pid --job --window --compute --overhead" ;;
    ledger)
      flags="--json"
      # `ledger cleanup GPU ID`: the subcommand word right after `ledger`.
      if ((COMP_CWORD == sub_at + 1)) && [[ $cur != -* ]]; then
        _steptrace_words "cleanup" "$cur"
        return
      fi
      ;;
    stats | version) flags="--json" ;;
    reset) flags="--pid --ledger --gpu" ;;
    top) flags="--interval --iterations --once --sort --job --window" ;;
    trace) flags="--pid --job --children --max-mb --last --for -o --output --force" ;;
    help)
      if ((COMP_CWORD == sub_at + 1)) && [[ $cur != -* ]]; then
        _steptrace_words "$subcommands" "$cur"
        return
      fi
      # help ledger <TAB>: the ledger's own subcommand.
      if ((COMP_CWORD == sub_at + 2)) && [[ ${COMP_WORDS[sub_at + 1]} == ledger && $cur != -* ]]; then
        _steptrace_words "cleanup" "$cur"
        return
      fi
      ;;
  esac
  # Global options may follow the subcommand too.
  [[ $cur == -* ]] && _steptrace_words "$flags $global" "$cur"
}

_steptraced() {
  local cur prev
  _steptrace_current
  COMPREPLY=()
  case $prev in
    --socket | --config)
      _steptrace_paths "$cur"
      return
      ;;
    --state-dir)
      _steptrace_paths -d "$cur"
      return
      ;;
    --log-level)
      _steptrace_words "trace debug info warn error critical off" "$cur"
      return
      ;;
    --nvml)
      _steptrace_words "off auto on" "$cur"
      return
      ;;
    --metrics-listen)
      return # ADDR:PORT
      ;;
  esac
  _steptrace_words "--socket --config --state-dir --metrics-listen --log-level --nvml --help --version" "$cur"
}

complete -F _steptrace steptrace
complete -F _steptraced steptraced
