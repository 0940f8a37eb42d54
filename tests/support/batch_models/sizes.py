"""The sizes the catalogue's models and inputs share."""

N, T, D, E = 4, 3, 8, 6  # batch, time, features, hidden: all different, so inputs are classified right
C, HW = 3, 6  # image channels and side
