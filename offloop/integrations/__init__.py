"""Keep your trainer: Lightning's and Hugging Face's trainers publish to offloop.

`offloop.integrations.lightning.OffloopCallback` and
`offloop.integrations.transformers.OffloopCallback` map their trainer's hooks to
Composer's events (docs/integrations.md) and run offloop's callbacks in worker processes,
with the bus, `offloop attach`, `halt`, `checkpoint`, the exporter and replay unchanged.
"""
