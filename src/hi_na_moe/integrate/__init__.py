"""transformers integration: discovery (adapters), families, enable / disable / inspect
(patching), the report, the ExpertsInterface registration and from_pretrained."""
