"""Talking to agents: the one transport seam (`transport`, `sockio`), many requests in one
write (`batch`), one method per agent route (`client`), their errors naming the node
(`errors`), and every agent observed at once (`observe`)."""
