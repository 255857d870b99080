"""Training data: reading corpora, writing token datasets, and each step's batch.

One module per concern:

- :mod:`.shipped`: the corpus and the tokenizer shipped in ``portapipe/assets/``;
- reading: :mod:`.readers` (text, jsonl, parquet, Hugging Face datasets; plain, gzip, zstd),
  :mod:`.tokenizer` (a Hugging Face ``tokenizer.json``, its EOS and hash);
- writing: :mod:`.writer` (``portapipe tokenize``: parallel workers, one ordered output),
  :mod:`.folder` (the dataset folder: tokens, document index, description);
- sources: :mod:`.folder`, :mod:`.megatron` (Megatron-Core's indexed datasets), :mod:`.flat`
  (flat token files), all memory-mapped behind :class:`~.sources.Source`;
- batches: :mod:`.corpus` (the configured sources and their train / validation parts, checked
  before launch), :mod:`.blend` (samples to sources by weight), :mod:`.epochs` (each epoch's
  seeded order), :mod:`.samples` (windows to micro-batches, document positions and loss mask),
  :mod:`.batches` (a step's batch from the step alone), :mod:`.identity` (what a checkpoint
  records of the sources).

Import from the modules themselves: this package's own import stays light, so ``portapipe
tokenize`` and its workers never load torch.
"""
