"""Chat templates: the Jinja template that turns chat messages into the model's prompt text.

Where it comes from, in order: `--chat-template FILE`; else the checkpoint's own, as transformers saves it beside
the tokenizer (`chat_template.jinja`, or the "chat_template" field of `tokenizer_config.json`) in the step folder
or its run folder. A model without one still serves /v1/completions; /v1/chat/completions then answers 400 with
a message naming both places. Templates run in Jinja's immutable sandbox (a template is code from a file).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..errors import LinattnError
from .protocol import ApiError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplateError(LinattnError):
    """A chat template that cannot be read or compiled."""


def _from_tokenizer_config(path: Path) -> Optional[str]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"cannot read {path}: {e}") from None
    t = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(t, list):  # named templates: the "default" one
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) and t.strip() else None


def find_template_source(step_dir: Path) -> Optional[tuple]:
    """(template text, where it was found) from a checkpoint's step folder or run folder, or None."""
    for folder in (step_dir, step_dir.parent):
        f = folder / TEMPLATE_FILE
        if f.is_file():
            return f.read_text(encoding="utf-8"), str(f)
        cfg = folder / TOKENIZER_CONFIG
        if cfg.is_file():
            text = _from_tokenizer_config(cfg)
            if text is not None:
                return text, str(cfg)
    return None


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: The Jinja text.
        origin: Where it came from (shown in errors).
        bos_token: The text of the start token the template may use.
        eos_token: The text of the end token the template may use.
    """

    def __init__(self, source: str, origin: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):  # what transformers' templates call to refuse a conversation
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template {origin} does not compile: {e}") from None
        self.origin = origin
        self.special = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: List[Dict[str, str]]) -> str:
        """The prompt text of `messages`, ending with the assistant's turn; ApiError 400 when the template
        refuses them."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as e:
            raise ApiError(400, f"messages: the chat template refused them: {e}", param="messages",
                           code="invalid_value") from None


def load_renderer(step_dir: Path, template_file: Optional[str], eos_token: str) -> Callable[[List[Dict]], str]:
    """`render(messages) -> prompt text` for the server: from `template_file`, else the checkpoint's template,
    else a function that answers 400 naming both.

    Raises:
        ChatTemplateError: A template that cannot be read or compiled.
    """
    if template_file is not None:
        try:
            found = (Path(template_file).read_text(encoding="utf-8"), template_file)
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"--chat-template: cannot read {template_file}: {e}") from None
    else:
        found = find_template_source(step_dir)
    if found is None:
        def no_template(messages):
            raise ApiError(400, f"this model has no chat template: none in its checkpoint ({TEMPLATE_FILE} or "
                                f"{TOKENIZER_CONFIG} in {step_dir} or its run folder), and the server was "
                                f"started without --chat-template FILE; use /v1/completions or restart with "
                                f"--chat-template", param="messages", code="no_chat_template")
        return no_template
    return ChatTemplate(found[0], found[1], eos_token=eos_token).render
