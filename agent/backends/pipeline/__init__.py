"""A pipeline stage over torch.distributed: the launch spec (`spec`), the stage process
(`stage`), its group, links, rows, engine, model and web parts."""
