"""The built-in tool environment of the arithmetic task: a calculator (``builtin:arithmetic_calculator``).

The task (``trainer.data.tasks.arithmetic``) asks word problems whose rows have ``prompt`` and ``answer``;
the recipe's reward functions (``builtin:arithmetic.exact_answer``) score the final answer, so the environment
only offers the tool. ``calculate`` evaluates integer arithmetic by walking the expression's ``ast`` with a
whitelist of nodes: nothing a model writes is executed as code.
"""

from __future__ import annotations

import ast
from fractions import Fraction

from trainer.environments.tools import Toolbox, ToolEnvironment

__all__ = ["MAX_EXPRESSION_CHARS", "TOOLS", "ArithmeticCalculator", "calculate"]

# Long enough for any multi-step problem; bounds the work a model can ask for (no powers, so a product of this
# many digits is still a small int).
MAX_EXPRESSION_CHARS = 200

_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.Div: lambda a, b: a / b}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression on integers with + - * / and parentheses.

    Args:
        expression: The expression to evaluate, for example "(7 - 2) * 3".

    Returns:
        The exact result: an integer, or a decimal when a division leaves a remainder.
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r} ({e.msg})") from None
    value = _evaluate(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return format(float(value), ".10g")


def _evaluate(node: ast.AST) -> Fraction:
    # Fractions keep 7 / 2 * 2 exact; bool is an int subclass but not a number here.
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    shown = ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__
    raise ValueError(f"only integers, + - * / and parentheses are allowed; found {shown!r}")


TOOLS = {"calculate": calculate}


class ArithmeticCalculator(ToolEnvironment):
    """The calculator as an environment class (``env.class: builtin:arithmetic_calculator``): no arguments needed."""

    _toolbox: Toolbox | None = None

    def __init__(self, max_turns: int = 4, timeout_s: float | None = 5.0):
        if ArithmeticCalculator._toolbox is None:  # schemas made once per process, not per episode
            ArithmeticCalculator._toolbox = Toolbox(TOOLS)
        super().__init__(ArithmeticCalculator._toolbox, max_turns=max_turns, timeout_s=timeout_s)
