"""Model families as data: one ``Family`` record per Hugging Face ``model_type``, written in the
module of its family group (``llama.py``, ``qwen.py``, ``gemma.py``, ...), each module listing its
records in ``FAMILIES``. A record names the architectures config.json may give, the config
features the family turns on (read by the generic parser in ``jaxserve/config.py``) and its
weight tables (``fields.py``); ``registry.py`` collects the records of every module here and is
where the rest of jaxserve looks a family up."""
