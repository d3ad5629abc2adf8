"""What runs: the stack as one context, the backend registry and what each backend refuses, the
mechanisms a model needs, the variant twins, torch.compile."""
