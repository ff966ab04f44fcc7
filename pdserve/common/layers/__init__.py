"""Model building blocks: attention (backend registry), rotary, norm, activation, embedding, sampler."""
