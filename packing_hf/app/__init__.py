"""The ``packing-hf`` command-line app, built on the library (nothing in the library imports it).

- ``cli``: the ``packing-hf {train,stats,verify}`` entry point;
- ``config``: YAML + ``key=value`` overrides -> dataclasses (model, data, job, training arguments);
- ``data``: dataset loading, record formats, prompt rendering, tokenization with loss masks;
- ``modeling``: model and tokenizer loading (folders, Hub ids, GGUF files in packages, ``from_config``);
- ``train``: the train job and its summary; ``baseline``: the padded baseline measured in the same run;
- ``stats``: ``packing-hf stats`` (batching strategies on a dataset, plots);
- ``verify``: ``packing-hf verify`` (one model, one architecture, or the whole registry as a table).
"""
