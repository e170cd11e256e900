"""Static guards that pyright cannot express."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) in {"triton.jit", "jit"}


def _is_constexpr(annotation: ast.expr) -> bool:
    return ast.unparse(annotation) in {"tl.constexpr", "triton.language.constexpr", "constexpr"}


def jit_parameters_with_annotations(source: str, filename: str) -> list[str]:
    """Name every annotated, non-constexpr parameter of a @triton.jit function."""
    offenders: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.FunctionDef) or not any(_is_triton_jit(d) for d in node.decorator_list):
            continue
        arguments = node.args
        for parameter in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
            if parameter.annotation is not None and not _is_constexpr(parameter.annotation):
                offenders.append(
                    f"{filename}:{node.lineno} {node.name}({parameter.arg}: {ast.unparse(parameter.annotation)})"
                )
    return offenders


def test_triton_jit_parameters_carry_no_annotation_but_constexpr() -> None:
    # Triton specialises on annotations: `n: int` would make offsets i32 and
    # wrap past 2 GiB, so only tl.constexpr may be written on a jit parameter.
    offenders: list[str] = []
    for path in sorted(KERNELS.rglob("*.py")):
        offenders += jit_parameters_with_annotations(path.read_text(), str(path.relative_to(ROOT)))
    assert offenders == []


def test_the_guard_catches_an_annotated_jit_parameter() -> None:
    source = (
        "import triton\nimport triton.language as tl\n"
        "@triton.jit\ndef k(x_ptr, n: int, BLOCK: tl.constexpr):\n    pass\n"
    )
    assert jit_parameters_with_annotations(source, "k.py") == ["k.py:4 k(n: int)"]


def test_kvtriton_kernels_is_the_top_level_kernels_folder() -> None:
    link = ROOT / "kvtriton" / "kernels"
    assert link.is_symlink() and link.resolve() == KERNELS
