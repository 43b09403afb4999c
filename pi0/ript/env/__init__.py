"""The seed's RIPT env runners: ``LIBEROEnvRunner`` (greedy, openpi's LIBERO eval layout) and ``PI0LiberoRunner``
(RIPT-VLA: the K rollouts of a state run together), both the shared ``pi0.rollout.RolloutRunner`` with a preset."""
