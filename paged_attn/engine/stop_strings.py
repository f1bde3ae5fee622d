"""Stop strings (``SamplingParams.stop``): whether a sequence's generated text now contains one, and the text cut
at it, as vLLM does it: the check runs on the detokenized text after every token, so a stop string may span token
boundaries and multi-byte characters; the completion's text ends before the first stop string in it (or after it,
with ``include_stop_str_in_output``), while its token ids keep every token generated, the last one the token whose
text completed the stop string.

Each step decodes only the last tokens (enough for the longest stop string: at least one character per token but
for byte-fallback tokens, up to four a character, and a few more for a character cut at the window's start), so a
long completion costs no more per token than a short one; the first stop string to appear is always found in that
window, since every earlier token was checked.
"""

from __future__ import annotations

from typing import Optional

WINDOW_SLACK_TOKENS = 8


def completes_stop(tokenizer, output_token_ids: list[int], stop: tuple[str, ...]) -> bool:
    """Whether the text of ``output_token_ids`` contains a stop string that the earlier tokens' did not (checked
    after each token: one ending in the last tokens' text)."""
    window = 4 * max(map(len, stop)) + WINDOW_SLACK_TOKENS
    tail = tokenizer.decode(output_token_ids[-window:])
    return any(s in tail for s in stop)


def cut_at_stop(tokenizer, output_token_ids: list[int], stop: tuple[str, ...],
                include: bool) -> Optional[tuple[str, str]]:
    """(the stop string, the text cut at its first occurrence) for a completion whose text contains one (the
    earliest one; of two at one place, the first listed), else None."""
    text = tokenizer.decode(output_token_ids)
    found = [(text.find(s), i, s) for i, s in enumerate(stop) if s in text]
    if not found:
        return None
    index, _, string = min(found)
    return string, text[:index + len(string)] if include else text[:index]
