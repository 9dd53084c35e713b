"""Chat templates for the test tokenizers, written from Qwen's documented ChatML format.

Real checkpoints bring their own template in tokenizer_config.json; these exist so random-weight checkpoints
render conversations exactly as Qwen2.5, Qwen3 and Qwen3.5 do for system / user / assistant turns, with
Qwen3's `enable_thinking` switch and its rule that past reasoning is dropped once a newer user turn follows.
Tool calls are not rendered (a real checkpoint's template handles them): passing `tools` raises.
"""

# Shared pieces: the ChatML turn, and the split of an assistant message into reasoning and answer.
_NO_TOOLS = """{%- if tools %}{{- raise_exception('this test chat template does not render tools') }}{%- endif %}"""

_SPLIT_REASONING = """
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}"""

# the index of the last user turn: reasoning of assistant turns before it is not shown to the model again
_LAST_QUERY = """
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}"""

_TURNS = (
    """
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'system' or message.role == 'user' %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}"""
    + _SPLIT_REASONING
    + """
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
            {{- content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('unsupported chat role: ' + message.role) }}
    {%- endif %}
{%- endfor %}"""
)

# Qwen3: thinks unless enable_thinking=False, which pre-fills an empty thought.
QWEN3 = (
    _NO_TOOLS
    + _LAST_QUERY
    + _TURNS
    + """
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
)

# Qwen3.5: the generation prompt always opens the thought (<think>\n), or closes it empty when thinking is off.
QWEN3_5 = (
    _NO_TOOLS
    + _LAST_QUERY
    + _TURNS
    + """
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}"""
)

# Qwen2.5 (Instruct): no thinking; a default system prompt when the conversation has none.
QWEN2 = (
    _NO_TOOLS
    + """
{%- if messages[0].role != 'system' %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role in ['system', 'user', 'assistant'] %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('unsupported chat role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
)
