"""Text into and out of the model: chat templates (`load_chat_template`), gpt-oss's Harmony format,
reasoning parsers (`PARSERS`), and tools: their checks, `tool_choice`, and each model family's
tool-call format (`TOOL_CALL_PARSERS`)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "chat_template": "chat_template", "load_chat_template": "chat_template",
    "chat_format": "harmony", "harmony_options": "harmony", "HarmonyChat": "harmony",
    "needs_special_tokens": "reasoning", "PARSERS": "reasoning", "ReasoningParser": "reasoning",
    "TOOL_CALL_PARSERS": "tool_parsers",
    "check_tool_schemas": "tools", "check_tools": "tools", "forced_calls": "tools",
    "forced_schema": "tools", "new_call_id": "tools", "strict_tool_tag": "tools",
    "tool_call_dict": "tools", "tool_choice_of": "tools", "ToolChoice": "tools",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
