"""Turn a question into the prompt text a model sees: its chat template, or a plain template.

Departure from ``str.format``: only the ``{question}`` placeholder is substituted, so
a template may contain literal braces such as ``\\boxed{}`` without escaping them.

Example::

    >>> render_prompt("What is 2+3?", template="{question}\\nPut the answer in \\\\boxed{}.")
    'What is 2+3?\\nPut the answer in \\\\boxed{}.'
"""

from __future__ import annotations

from logra_lightning.errors import ConfigError

PLACEHOLDER = "{question}"


def check_template(template: str) -> None:
    """Raise ``ConfigError`` unless ``template`` contains the ``{question}`` placeholder."""
    if not isinstance(template, str) or PLACEHOLDER not in template:
        raise ConfigError(f"template={template!r}: must contain the placeholder {PLACEHOLDER}")


def has_chat_template(tokenizer) -> bool:
    """True when ``tokenizer`` (a Hugging Face tokenizer) defines a chat template."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    question: str,
    tokenizer=None,
    template: str = PLACEHOLDER,
    system: str | None = None,
    use_chat_template: bool = True,
) -> str:
    """The prompt string for ``question``.

    The user message is ``template`` with ``{question}`` replaced. With a tokenizer
    that has a chat template (and ``use_chat_template``), the messages ``[system?, user]``
    go through ``tokenizer.apply_chat_template(..., add_generation_prompt=True,
    tokenize=False)``; otherwise the result is the user message, preceded by
    ``system`` and a blank line when a system prompt is given.

    Args:
        question: the problem text.
        tokenizer: a Hugging Face tokenizer, or ``None``.
        template: user-message template containing ``{question}``.
        system: optional system prompt.
        use_chat_template: set ``False`` to ignore the tokenizer's chat template.

    Raises:
        ConfigError: ``template`` lacks ``{question}``.
    """
    check_template(template)
    user = template.replace(PLACEHOLDER, question)
    if use_chat_template and has_chat_template(tokenizer):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return f"{system}\n\n{user}" if system else user
