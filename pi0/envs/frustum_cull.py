"""View-frustum culling for MuJoCo's offscreen renderer: skip the geoms a camera cannot see, for the same pixels.

Under llvmpipe (Mesa's CPU rasterizer) a small MuJoCo frame is bound by vertex work, not by pixels: MetaWorld's
Sawyer meshes carry about 67k triangles, and a 64-px frame costs about the same as a 16-px one. MuJoCo's
``mjr_render`` sends every geom of the scene through the vertex pipeline, including the arm behind a wrist camera.
:func:`cull_scene` marks the geoms whose bounding box lies wholly outside the camera's view volume as not drawn
(``mjGEOM_NONE``: ``renderGeom`` draws nothing for a type it does not know), after ``update_scene`` and before
``render``. A box wholly outside one plane of the frustum holds no visible vertex, so the image is the same bit for bit;
only the cast shadows and mirror images of geoms outside the view are lost, so the caller culls only when the shadow
and reflection passes are off (``MetaWorldEnv(fast_render=True)``).

The frustum is the one ``mjr_render`` builds (``render_gl3.c`` ``setView``, ``mjr_lookAt``), from the average of the
scene's two eye cameras for a mono render (each eye sits ``vis.global.ipd / 2`` to the side): eye at ``pos`` looking
along ``forward``, image x along ``forward x up``, half-width ``frustum_width`` or, when that is 0, the
viewport's aspect times half the height ``(top - bottom) / 2``, near and far planes at ``frustum_near/far``.
Stereo and orthographic views are drawn whole (nothing culled).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# the 8 corners of a box, as signs of its half-sizes
_SIGNS = np.array([[sx, sy, sz] for sx in (-1, 1) for sy in (-1, 1) for sz in (-1, 1)], np.float64)  # (8, 3)
MARGIN = 1e-3  # metres of slack on every plane, far above float32 rounding: only boxes clearly outside are culled


def box_corners(aabb: np.ndarray) -> np.ndarray:
    """(G, 6) boxes as MuJoCo's ``geom_aabb`` (centre xyz, half-sizes xyz, in the geom's frame) -> (G, 8, 3) corners."""
    aabb = np.asarray(aabb, np.float64)
    return aabb[:, None, :3] + _SIGNS[None] * aabb[:, None, 3:]


def outside_frustum(corners: np.ndarray, pos: np.ndarray, forward: np.ndarray, up: np.ndarray, center: float,
                    halfwidth: float, bottom: float, top: float, near: float, far: float,
                    margin: float = MARGIN) -> np.ndarray:
    """(G, 8, 3) world-frame box corners -> (G,) bool: True where every corner lies outside one and the same plane
    of the perspective frustum (``glFrustum(center -+ halfwidth, bottom, top, near, far)`` seen from ``pos``)."""
    forward = np.asarray(forward, np.float64)
    up = np.asarray(up, np.float64)
    right = np.cross(forward, up)  # as gluLookAt / mjr_lookAt: image x = forward x up
    rel = np.asarray(corners, np.float64) - np.asarray(pos, np.float64)
    x, y, z = rel @ right, rel @ up, rel @ forward  # (G, 8) each; z = depth along the view
    # a side plane through the eye and the near-plane edge at offset e: points with x * near < e * z are left of it;
    # its unit normal divides by sqrt(near^2 + e^2), so the margin is in metres
    left, right_ = center - halfwidth, center + halfwidth
    planes = (
        (x * near - left * z) / np.hypot(near, left),  # >= 0 right of the left plane
        (right_ * z - x * near) / np.hypot(near, right_),  # >= 0 left of the right plane
        (y * near - bottom * z) / np.hypot(near, bottom),  # above the bottom plane
        (top * z - y * near) / np.hypot(near, top),  # below the top plane
        z - near,  # in front of the near plane
        far - z,  # behind the far plane
    )
    return np.any([np.all(p < -margin, axis=1) for p in planes], axis=0)


class FrustumCuller:
    """Culls one model's geoms from a ``mujoco.Renderer``'s scene, camera by camera (module docstring)."""

    def __init__(self, model: Any):
        import mujoco

        self._mujoco = mujoco
        # boxes of the geoms that can be culled: every model geom but planes and height fields (unbounded or
        # drawn as the floor), whose culled flag is read per scene geom through its object id
        self._corners = box_corners(model.geom_aabb)  # (G, 8, 3), geom frame
        types = np.asarray(model.geom_type)
        self._cullable = (types != mujoco.mjtGeom.mjGEOM_PLANE) & (types != mujoco.mjtGeom.mjGEOM_HFIELD)

    def culled(self, data: Any, scene: Any, width: int, height: int) -> np.ndarray:
        """(G,) bool: the model geoms outside the view of ``scene``'s camera (as set by ``update_scene``)."""
        mj = self._mujoco
        # scene.camera holds the two eyes, each ipd / 2 (3.4 cm by default) off the camera; a mono render draws from
        # their average (mjr_render: mjv_averageCamera). Stereo (other viewports) and orthographic views are not
        # this module's frustum: cull nothing
        if scene.stereo != mj.mjtStereo.mjSTEREO_NONE:
            return np.zeros(len(self._cullable), bool)
        cam = mj.mjv_averageCamera(scene.camera[0], scene.camera[1])
        if cam.orthographic:
            return np.zeros(len(self._cullable), bool)
        xmat = np.asarray(data.geom_xmat, np.float64).reshape(-1, 3, 3)
        world = np.einsum("gij,gkj->gki", xmat, self._corners) + np.asarray(data.geom_xpos)[:, None]  # (G, 8, 3)
        halfwidth = cam.frustum_width or 0.5 * width / height * (cam.frustum_top - cam.frustum_bottom)
        out = outside_frustum(world, cam.pos, cam.forward, cam.up, cam.frustum_center, halfwidth, cam.frustum_bottom,
                              cam.frustum_top, cam.frustum_near, cam.frustum_far)
        return out & self._cullable

    def cull_scene(self, data: Any, scene: Any, width: int, height: int) -> int:
        """Mark the scene's geoms outside the view as not drawn; returns how many."""
        mj = self._mujoco
        out = self.culled(data, scene, width, height)
        n = 0
        for i in range(scene.ngeom):
            g = scene.geoms[i]
            if g.objtype == mj.mjtObj.mjOBJ_GEOM and g.category != mj.mjtCatBit.mjCAT_DECOR and out[g.objid]:
                g.type = mj.mjtGeom.mjGEOM_NONE
                n += 1
        return n


__all__ = ["FrustumCuller", "box_corners", "outside_frustum"]
