"""Plain ``nn.Module`` layers (usable without Detectron2) and their functional cores."""
