"""The transformers zoo: every vision-language and MoE causal LM the installed transformers ships, built tiny."""
