"""Measurements of the box that the serving path depends on (`ft bench ...`).

`bandwidth`: the two miss paths of the expert cache (PCIe expert copies, the host expert kernel), alone, against
their ceilings, and overlapped; `ft bench bw` writes them as the profile q* reads (`freetoken.moe.profile`).
"""
