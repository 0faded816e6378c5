"""DeepSeek's released chat templates, as their checkpoints' tokenizer_config.json carry them.

None of them reads the tool definitions (HF's ``tools``): V2.5, V3 and V3-0324 render an
assistant's calls as ``function<｜tool▁sep｜>NAME`` with the arguments in a ```json fence, V3.1 and
V3.2-Exp as ``NAME<｜tool▁sep｜>ARGUMENTS``.
"""

from __future__ import annotations

# DeepSeek-V3 and V3-0324
V3 = (
    r"{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    r"{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, "
    r"system_prompt='', is_first_sp=true) %}{%- for message in messages %}"
    r"{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    r"{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    r"{% set ns.is_first_sp = false %}{%- else %}"
    r"{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}"
    r"{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}"
    r"{%- for message in messages %}{%- if message['role'] == 'user' %}"
    r"{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    r"{%- if message['role'] == 'assistant' and message['content'] is none %}"
    r"{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}"
    r"{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + "
    r"tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + "
    r"tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}"
    r"{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + "
    r"'<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + "
    r"tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}"
    r"{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    r"{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    r"{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + "
    r"'<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}"
    r"{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    r"{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    r"{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + "
    r"'<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}"
    r"{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    r"{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}"
    r"{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)

# DeepSeek-V2.5: V3's, one system prompt only
V2_5 = V3.replace(", is_first_sp=true", "").replace(
    r"{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    r"{% set ns.is_first_sp = false %}{%- else %}"
    r"{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}",
    r"{% set ns.system_prompt = message['content'] %}",
)

# DeepSeek-V3.1 (and V3.1-Terminus, V3.2-Exp): thinking or not, calls as NAME<｜tool▁sep｜>ARGUMENTS
V3_1 = (
    r"{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    r"{% endif %}{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
    r"{% set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true, "
    r"is_last_user=false) %}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    r"{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    r"{% set ns.is_first_sp = false %}{%- else %}"
    r"{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}"
    r"{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}"
    r"{%- for message in messages %}{%- if message['role'] == 'user' %}"
    r"{%- set ns.is_tool = false -%}{%- set ns.is_first = false -%}"
    r"{%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    r"{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and "
    r"message['tool_calls'] is not none %}{%- if ns.is_last_user %}"
    r"{{'<｜Assistant｜></think>'}}{%- endif %}{%- set ns.is_last_user = false -%}"
    r"{%- set ns.is_first = false %}{%- set ns.is_tool = false -%}"
    r"{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}"
    r"{%- if message['content'] is none %}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ "
    r"tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + "
    r"'<｜tool▁call▁end｜>'}}{%- else %}{{message['content'] + "
    r"'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + "
    r"'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}{%- endif %}"
    r"{%- set ns.is_first = true -%}{%- else %}{{'<｜tool▁call▁begin｜>'+ "
    r"tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + "
    r"'<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}"
    r"{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    r"{%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or "
    r"message['tool_calls'] is none) %}{%- if ns.is_last_user %}{{'<｜Assistant｜>'}}"
    r"{%- if message['prefix'] is defined and message['prefix'] and thinking %}{{'<think>'}}"
    r"{%- else %}{{'</think>'}}{%- endif %}{%- endif %}{%- set ns.is_last_user = false -%}"
    r"{%- if ns.is_tool %}{{message['content'] + '<｜end▁of▁sentence｜>'}}"
    r"{%- set ns.is_tool = false -%}{%- else %}{%- set content = message['content'] -%}"
    r"{%- if '</think>' in content %}{%- set content = content.split('</think>', 1)[1] -%}"
    r"{%- endif %}{{content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    r"{%- if message['role'] == 'tool' %}{%- set ns.is_last_user = false -%}"
    r"{%- set ns.is_tool = true -%}{{'<｜tool▁output▁begin｜>' + message['content'] + "
    r"'<｜tool▁output▁end｜>'}}{%- endif %}{%- endfor -%}"
    r"{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool %}"
    r"{{'<｜Assistant｜>'}}{%- if not thinking %}{{'</think>'}}{%- else %}{{'<think>'}}"
    r"{%- endif %}{% endif %}"
)
