"""Tokenizer of the cluster query language (see ``kiln.cluster.query``)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.cluster.errors import InvalidParameterException

_SYMBOLS = ("==", "!=", ">=", "<=", "=~", "!~", "&&", "||", ">", "<", "(", ")", "[", "]", ",")
_WORD_STOP = set(" \t\r\n()[],'\"=!<>&|")


@dataclass(frozen=True)
class Token:
    kind: str  # "symbol" | "word" | "string" | "end"
    text: str
    position: int  # 1-based column of the first character


def query_error(expression: str, position: int, reason: str) -> InvalidParameterException:
    return InvalidParameterException(
        f"invalid memberOf expression at position {position}: {reason} (expression: {expression!r})"
    )


def tokenize(expression: str) -> list[Token]:
    tokens: list[Token] = []
    index = 0
    while index < len(expression):
        char = expression[index]
        if char.isspace():
            index += 1
            continue
        column = index + 1
        if char in "'\"":
            end = expression.find(char, index + 1)
            if end < 0:
                raise query_error(
                    expression, column, f"unterminated quoted value; close it with {char}"
                )
            tokens.append(Token("string", expression[index + 1 : end], column))
            index = end + 1
            continue
        if expression.startswith("!exists", index):
            tokens.append(Token("word", "!exists", column))
            index += len("!exists")
            continue
        symbol = next((s for s in _SYMBOLS if expression.startswith(s, index)), None)
        if symbol is not None:
            tokens.append(Token("symbol", symbol, column))
            index += len(symbol)
            continue
        if char in _WORD_STOP:
            raise query_error(expression, column, f"unexpected character {char!r}")
        end = index
        while end < len(expression) and expression[end] not in _WORD_STOP:
            end += 1
        tokens.append(Token("word", expression[index:end], column))
        index = end
    tokens.append(Token("end", "", len(expression) + 1))
    return tokens
