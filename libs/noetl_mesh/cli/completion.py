"""Shell completion for ``noetl``: ``noetl completion bash|zsh|fish`` prints a script made from the
command line's own parser (its commands, their sub-commands and options, and the choices of options
that have them), so it never lags behind the commands. Nothing runs at completion time but the shell.

    eval "$(noetl completion bash)"        # ~/.bashrc
    eval "$(noetl completion zsh)"         # ~/.zshrc (through bash completion: bashcompinit)
    noetl completion fish | source         # ~/.config/fish/config.fish
"""
from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator

__all__ = ["script", "SHELLS"]

SHELLS = ("bash", "zsh", "fish")


def add_commands(sub, root: argparse.ArgumentParser) -> None:
    """completion: the script of ``root``, the whole command line's parser (complete by the time it runs)."""
    p = sub.add_parser("completion", help="print shell completion: eval \"$(noetl completion bash)\" (zsh, fish too)")
    p.add_argument("shell", choices=["bash", "zsh", "fish"], help="which shell's script")
    p.set_defaults(func=cmd_completion, parser=root)


def cmd_completion(args: argparse.Namespace) -> int:
    """``noetl completion bash|zsh|fish``: the shell's completion script, from this parser."""
    print(script(args.shell, args.parser), end="")
    return 0


def _tree(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], list[str], list[str], dict[str, list[str]], dict[str, str]]]:
    """(path, sub-commands, options, choices by option, help by sub-command) for every parser."""
    subs: list[str] = []
    helps: dict[str, str] = {}
    children = []
    options: list[str] = []
    choices: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps.update({a.dest: a.help or "" for a in action._choices_actions})
            for name, child in action.choices.items():
                subs.append(name)
                children.append((name, child))
        elif action.option_strings:
            options += [o for o in action.option_strings if o.startswith("--")]
            if action.choices:
                for o in action.option_strings:
                    choices[o] = [str(c) for c in action.choices]
    yield path, subs, options, choices, helps
    for name, child in children:
        yield from _tree(child, (*path, name))


def _bash(parser: argparse.ArgumentParser) -> str:
    cases = []
    for path, subs, options, choices, _ in _tree(parser):
        key = " ".join(path)
        words = " ".join(subs + options)
        label = shlex.quote(key) if key else "''"
        cases.append(f"        {label}) words={shlex.quote(words)} ;;")
        for option, values in choices.items():
            cases.append(f"        {shlex.quote((key + ' ' + option).strip())}) words={shlex.quote(' '.join(values))} ;;")
    return """# noetl completion for bash (and zsh with bashcompinit): eval "$(noetl completion bash)"
_noetl_complete() {
    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}" path="" i w words=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${COMP_WORDS[i]}"
        case "$w" in -*) ;; *) case " $(_noetl_words "$path") " in *" $w "*) path="${path:+$path }$w" ;; esac ;; esac
    done
    case "$prev" in --*) words="$(_noetl_words "${path:+$path }$prev")" ;; esac
    [ -z "$words" ] && words="$(_noetl_words "$path")"
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
    [ ${#COMPREPLY[@]} -eq 0 ] && COMPREPLY=($(compgen -f -- "$cur"))
}
_noetl_words() {
    local words=""
    case "$1" in
""" + "\n".join(cases) + """
    esac
    echo "$words"
}
complete -o filenames -F _noetl_complete noetl
"""


def _zsh(parser: argparse.ArgumentParser) -> str:
    return "# noetl completion for zsh: eval \"$(noetl completion zsh)\"\nautoload -U +X bashcompinit && bashcompinit\n" \
        + _bash(parser)


def _fish(parser: argparse.ArgumentParser) -> str:
    lines = ["# noetl completion for fish: noetl completion fish | source", "complete -c noetl -f"]
    for path, subs, options, choices, helps in _tree(parser):
        if not path:
            cond = "__fish_use_subcommand"
        else:
            cond = " && ".join(f"__fish_seen_subcommand_from {shlex.quote(p)}" for p in path)
            if subs:
                cond += " && not __fish_seen_subcommand_from " + " ".join(shlex.quote(s) for s in subs)
        for sub in subs:
            lines.append(f"complete -c noetl -n {shlex.quote(cond)} -a {shlex.quote(sub)} -d {shlex.quote(helps.get(sub, ''))}")
        for option in options:
            values = choices.get(option)
            extra = f" -x -a {shlex.quote(' '.join(values))}" if values else ""
            lines.append(f"complete -c noetl -n {shlex.quote(cond)} -l {shlex.quote(option[2:])}{extra}")
    return "\n".join(lines) + "\n"


def script(shell: str, parser: argparse.ArgumentParser) -> str:
    return {"bash": _bash, "zsh": _zsh, "fish": _fish}[shell](parser)
