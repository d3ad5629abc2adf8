"""What a stage program (kvfid.stages.program) is checked for before any compute: that its
stages and suffix fit the model's context, that its arms can rebuild it, that the model's layers
attend through the mask only. Each refusal is one line (ProtocolError, exit 2)."""

from __future__ import annotations

from kvfid.protocol.constructions import ProtocolError, parse_construction

ARMS = ("prefill", "incremental", "chunked:N")


def program_length(prompt_length: int, program, opener_lengths: list[int]) -> int:
    """Tokens of the merge boundary P: prompt, delimiters, branch and merge tokens."""
    return (prompt_length + sum(opener_lengths) + program.branches * program.branch_tokens
            + program.merge_tokens)


def check_program_fits(prompt_length: int, program, opener_lengths: list[int], S: int,
                       context_length: int) -> None:
    """Refuse before compute a program whose stages and suffix pass the model's context."""
    need = program_length(prompt_length, program, opener_lengths) + S
    if need > context_length:
        raise ProtocolError(f"--program {program.label}: prompt ({prompt_length}) + stages + S "
                            f"({S}) = {need} tokens exceed the model's context of {context_length}")


def check_arms(arms: tuple[str, ...]) -> None:
    """Refuse before compute an arm a stage program cannot be rebuilt by."""
    for label in arms:
        construction = parse_construction(label)
        if not (construction.regenerates or construction.rebuilds_stages):
            raise ProtocolError(f"--constructions {label}: a stage program is rebuilt by live, "
                                f"{', '.join(ARMS)}")


def check_plan(arms: tuple[str, ...], replicas: tuple[str, ...]) -> None:
    """Refuse before compute arms without live (every arm is compared with it), a replica that
    is not among the arms, an arm a stage program cannot be rebuilt by."""
    if "live" not in arms:
        raise ProtocolError(f"--constructions {','.join(arms)}: a stage program's arms are compared with "
                            f"live; include it")
    for label in replicas:
        if label not in arms:
            raise ProtocolError(f"--replicas {label}: not among --constructions ({','.join(arms)})")
    check_arms(arms)


def check_layers(layers) -> None:
    """Refuse a model whose layers a stage program's mask cannot describe: the 4-D mask reaches
    every layer as it is, so a sliding-window or chunked layer would lose its window on one
    backend and be refused by another; a recurrent layer sees no mask at all."""
    for info in layers:
        local = set(info.mechanisms) & {"sliding_window", "chunked_attention", "recurrent"}
        if local:
            raise ProtocolError(f"--program: layer {info.index} is {sorted(local)[0]}; stage "
                                "programs serve models whose layers attend through the mask only")


def stage_names(program) -> list[str]:
    """The stages' names as case files and `segment=NAME` spell them: prompt, branch1.., merge."""
    return ["prompt", *[f"branch{i + 1}" for i in range(program.branches)], "merge"]


def parse_sees(program, table: dict) -> tuple[tuple[int, ...], ...]:
    """`{stage: [stages it sees]}` (stages not named keep the contract: a branch sees the prompt
    and itself, the merge everything) -> `Program.sees`. Refused in one line: an unknown stage, a
    stage seeing a later one (causality: its keys do not exist yet), and in the batched layout a
    branch seeing another branch (rows of one batch cannot see each other)."""
    names = stage_names(program)
    sees = [tuple(sorted({0, i} | ({*range(len(names))} if i == len(names) - 1 else set())))
            for i in range(len(names))]
    for stage, seen in table.items():
        for name in (stage, *seen):
            if name not in names:
                raise ProtocolError(f"[program] sees: stage {name!r}; valid: {', '.join(names)}")
        at = names.index(stage)
        later = next((name for name in seen if names.index(name) > at), None)
        if later is not None:
            raise ProtocolError(f"[program] sees: {stage} sees {later}, a later stage; a stage "
                                f"sees only itself and the stages before it")
        others = [name for name in seen if names.index(name) not in (0, at)]
        if program.layout == "batched" and 0 < at < len(names) - 1 and others:
            raise ProtocolError(f"[program] sees: {stage} sees {others[0]}; batched branches are "
                                f"rows of one batch and see only the prompt and themselves")
        sees[at] = tuple(sorted({0, at, *(names.index(name) for name in seen)}))
    return tuple(sees)
